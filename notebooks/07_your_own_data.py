# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Your own data: from a CSV file to a fitted posterior and a served prediction
#
# Your sequences are probably in a table already: one row per time step, a column naming
# the sequence, a column giving the step's time, a few measurements, and a label. This
# notebook takes such a file from disk to a served prediction:
#
# 1. a CSV in the *long* layout, written here from a real data set: the Japanese vowels
#    recordings (9 speakers, 12 cepstral coefficients per frame, utterances of 7-29 frames);
# 2. `from_table`: train, validation and test splits, with the classes, ragged lengths and
#    feature scaling taken from the file (the scaling learned on the training split only);
# 3. an SVI fit, its test metrics and its ArviZ `InferenceData`;
# 4. the same file fitted by `probtransformer fit --data`, and a prediction from the
#    HTTP service for rows in the file's own units.
#
# With `PROBTRANSFORMER_SMOKE=1` (as the test suite runs it) the fits are a few steps and
# the numbers mean nothing. A full run takes about two minutes on two CPU cores.

# %%
import os
import tempfile
from pathlib import Path

import pandas as pd
import torch
from fastapi.testclient import TestClient  # the serve extra

from probtransformer import datasets, metrics
from probtransformer.cli import main
from probtransformer.datasets import from_table
from probtransformer.inference import fit_svi
from probtransformer.models import SequenceClassifier
from probtransformer.rundir import read_run
from probtransformer.serving import Service, create_app

SMOKE = os.environ.get("PROBTRANSFORMER_SMOKE") == "1"
pd.set_option("display.max_columns", None, "display.width", 200)  # print every column
torch.set_num_threads(1)  # small models: a second thread costs more than it saves
WORK = Path(tempfile.mkdtemp(prefix="own-data-"))

# %% [markdown]
# ## 1. A CSV file of ragged sequences
#
# The recordings ship with sktime (the `datasets` extra). Here they are written out the way
# a lab would keep them: one row per frame, with the speaker's name as the label.

# %%
vowels = datasets.load("JapaneseVowels", seed=0)
rows, count = [], 0
for part in (vowels.train, vowels.val, vowels.test):
    for x, y, mask in zip(part.x, part.y, part.mask, strict=True):
        count += 1
        for frame, features in enumerate(x[mask].tolist()):
            row = {"utterance": f"u{count:04d}", "frame": frame, "speaker": f"speaker {int(y) + 1}"}
            rows.append(row | {f"c{i + 1}": value for i, value in enumerate(features)})
table = pd.DataFrame(rows)
if SMOKE:  # a third of the utterances
    table = table[table["utterance"] <= "u0210"]
csv = WORK / "vowels.csv"
table.to_csv(csv, index=False)
print(f"{csv.name}: {len(table):,} rows, {table['utterance'].nunique()} utterances")
print(table.head())

# %% [markdown]
# ## 2. Splits from the file
#
# `from_table` reads the file (refusing one over `MAX_TABLE_BYTES`, 1 GiB), checks it, and
# carves 25% of the utterances as test and 10% of the rest as validation, stratified by
# speaker. Every check names the file, the column and the row: a missing value, a frame
# out of order, an utterance with two speakers, a column mixing numbers and text. The
# shorter utterances are padded at the end and masked. `meta["table"]` is the schema, plain
# JSON: the classes, the columns and the scaling, which is what encodes new data the same
# way (`SequenceData.from_pandas(frame, schema=TableSchema.from_dict(meta["table"]))`).

# %%
splits = from_table(csv, target="speaker", id="utterance", time="frame", seed=0)
meta = splits.meta
train, test = splits.train, splits.test
if SMOKE:
    train, test = train[:90], test[:45]
print(train, test, sep="\n")
print("classes:", meta["class_names"])
print("feature means after scaling (train):", train.x[train.mask].mean(0)[:4].round(decimals=3))

# %% [markdown]
# ## 3. A posterior, its metrics and its diagnostics
#
# The classifier is built from the meta: 12 features per step, 9 classes, up to `max_len`
# frames. `fit_svi` returns the `Posterior`; its predictive mean goes into the usual
# metrics, and `to_inference_data` gives ArviZ the log-likelihood of every training row.

# %%
model = SequenceClassifier(
    meta["in_features"], meta["num_classes"], meta["max_len"], d_model=16, num_heads=2,
    num_layers=1, d_ff=32,
)  # fmt: skip
post = fit_svi(model, train, num_steps=30 if SMOKE else 1500, seed=0, progress=False)
pred = post.predict(test.x, test.mask, num_samples=10 if SMOKE else 100, seed=0)
report = metrics.classification_report(pred.mean, test.y)
print({name: round(value, 3) for name, value in report.items()})

# %%
idata = post.to_inference_data(train, num_samples=10 if SMOKE else 100)
print(idata)

# %% [markdown]
# ## 4. The same file from the command line, and a served prediction
#
# `probtransformer fit --data FILE --target COL --id COL --time COL` does steps 2 and 3 and
# writes a run directory; `predict RUN --input FILE` reads files of the same layout and
# `serve RUN` answers HTTP requests. The service applies the run's scaling itself, so a
# client sends frames in the file's units. Here the service runs in this process (FastAPI's
# test client, from the `serve` extra) instead of on a port.

# %%
steps = ["--num-steps", "30", "--num-samples", "10"] if SMOKE else []
run_dir = WORK / "run"
args = ["fit", "--data", str(csv), "--target", "speaker", "--id", "utterance", "--time", "frame"]
assert main([*args, "--out", str(run_dir), "--no-progress", *steps]) == 0

# %%
utterance = table[table["utterance"] == table["utterance"].iloc[-1]]
frames = utterance[[f"c{i}" for i in range(1, 13)]].to_numpy().tolist()
with TestClient(create_app(Service(read_run(run_dir), num_samples=10))) as client:
    print(client.get("/metadata").json()["classes"])
    answer = client.post("/predict", json={"sequences": [frames]}).json()["rows"][0]
truth = utterance["speaker"].iloc[0]
print(f"{truth}: predicted {answer['predicted_label']}, epistemic {answer['epistemic']:.4f} nats")
