"""``fit``'s default intra-op threads (``probtransformer.cli.threads``): one thread unless the
model and batch are large enough for more to pay and cores are idle to run them."""

import pytest

from probtransformer.cli.threads import MIN_PARALLEL_WORK, default_threads, forward_work

#: ``SequenceClassifier``'s digits defaults (the main job): d_model 64, 2 layers, d_ff 128
DIGITS = dict(d_model=64, max_len=8, num_layers=2, d_ff=128)
LARGE = dict(d_model=512, max_len=64, num_layers=6, d_ff=2048)


def test_forward_work_counts_projections_feed_forward_and_attention():
    # per layer and step: 4 * 64**2 + 2 * 64 * 128 + 2 * 8 * 64 = 33,792 multiply-adds
    assert forward_work(DIGITS, batch_rows=128) == 128 * 8 * 2 * 33_792
    assert forward_work({"in_features": 8}, batch_rows=128) is None


@pytest.mark.parametrize("load", [0.0, 1.0, 8.0])
@pytest.mark.parametrize("cores", [2, 16])
def test_the_main_job_takes_one_thread_however_idle_the_machine(cores, load):
    threads, why = default_threads(DIGITS, 128, cores=cores, load=load)
    assert threads == 1 and "too small" in why


def test_a_model_without_transformer_sizes_takes_one_thread():
    assert default_threads({"in_features": 8}, 128, cores=16, load=0.0)[0] == 1


@pytest.mark.parametrize(
    ("cores", "load", "expected"), [(16, 0.0, 16), (16, 5.2, 11), (2, 1.0, 1), (2, 8.0, 1)]
)
def test_a_large_model_takes_one_thread_per_idle_core(cores, load, expected):
    assert forward_work(LARGE, 64) > MIN_PARALLEL_WORK
    threads, why = default_threads(LARGE, 64, cores=cores, load=load)
    assert threads == expected and f"{expected} of {cores} cores idle" in why
