"""The Laplace approximation: a Gaussian around a MAP fit or around each member of a deep
ensemble (MoLA), its curvature (``curvature``), evidence and prior precision (``evidence``),
and ``fit_laplace``/``fit_mola`` (``fit``)."""
