"""A multiple-choice task for lm-evaluation-harness (PyPI `lm_eval`) over a
local JSON-lines file, run against a PagedServe server with lm_eval's
`local-completions` model: the loglikelihood requests real evaluation runs send
(`echo: true, logprobs: 1, max_tokens: 1` with token-id prompts), tokenized
through the server's own /tokenize (lm_eval's `remote` tokenizer backend, which
reads /tokenizer_info first). Nothing comes from a model hub: the dataset is the
file (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set for the run).

Each line of the data file: {"question": str, "choices": [str, ...], "answer": int}.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TASK_NAME = "pagedserve_tiny_mc"

_TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@dataclass
class EvalRun:
    """One lm_eval run. accuracy: fraction of questions whose gold choice had the
    highest log-likelihood (lm_eval's `acc`); samples: lm_eval's logged samples
    (each with `arguments` [[context, continuation], ...] and `resps`
    [[[loglikelihood, is_greedy]], ...] per choice)."""

    accuracy: float
    samples: list[dict]


def write_task(data_file: str | Path, directory: str | Path) -> Path:
    """Writes the task's YAML (naming data_file by its absolute path) into
    directory; returns the directory (lm_eval's --include_path)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{TASK_NAME}.yaml").write_text(
        _TASK_YAML.format(name=TASK_NAME, data=json.dumps(str(Path(data_file).resolve()))))
    return directory


def run_lm_eval(base_url: str, model: str, data_file: str | Path, workdir: str | Path,
                timeout_s: float = 900) -> EvalRun:
    """Runs `python -m lm_eval` (local-completions, remote tokenizer, one
    request at a time) against base_url (e.g. http://127.0.0.1:8000) serving
    `model`. Raises subprocess.CalledProcessError (with lm_eval's output) if it
    fails, subprocess.TimeoutExpired after timeout_s seconds."""
    workdir = Path(workdir)
    include = write_task(data_file, workdir / "tasks")
    out_dir = workdir / "out"
    args = ",".join([f"base_url={base_url}/v1/completions", f"model={model}", "tokenizer_backend=remote",
                     "tokenized_requests=True", "num_concurrent=1", "max_retries=1"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(workdir / "datasets-cache")}
    subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                    "--tasks", TASK_NAME, "--include_path", str(include), "--log_samples",
                    "--output_path", str(out_dir)],
                   check=True, env=env, timeout=timeout_s, capture_output=True, text=True)
    (results,) = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    (samples,) = glob.glob(str(out_dir / "**" / f"samples_{TASK_NAME}_*.jsonl"), recursive=True)
    accuracy = json.loads(Path(results).read_text())["results"][TASK_NAME]["acc,none"]
    return EvalRun(accuracy, [json.loads(line) for line in Path(samples).read_text().splitlines() if line])
