"""Tokenise FineWeb-edu (or any Hugging Face dataset, or local text/jsonl files) into shards.

By default streams HuggingFaceFW/fineweb-edu, configuration sample-10BT (10B GPT-2 tokens), into
100M-token uint16 shards in data/edu_fineweb10B (build-nanogpt's layout: the first shard is the
val split), using half the CPU cores for tokenising. Needs `pip install datasets` and about
20 GB of disk. Local files need nothing extra:

    python examples/prepare_fineweb.py                                 # FineWeb-edu 10B
    python examples/prepare_fineweb.py --max-docs 10000 --out-dir data/fineweb_small
    python examples/prepare_fineweb.py --input corpus/*.txt --out-dir data/mine --shard-size 1000000
    python examples/prepare_fineweb.py --input docs.jsonl --text-field body --out-dir data/mine

Then train on the shards: examples/train_gpt2_124m.py --data data/edu_fineweb10B. This script is
`gpt2 prepare` with FineWeb-edu defaults.
"""

import os
import sys

from gpt2.cli import run_command

DEFAULTS = {
    "dataset": "HuggingFaceFW/fineweb-edu",
    "dataset_config": "sample-10BT",
    "out_dir": "data/edu_fineweb10B",
    "prefix": "edufineweb",
    "num_workers": max(1, (os.cpu_count() or 2) // 2),
}

if __name__ == "__main__":
    sys.exit(run_command("prepare", prog="prepare_fineweb.py", defaults=DEFAULTS, description=__doc__))
