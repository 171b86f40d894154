"""Fine-tune GPT-2 with LoRA on a text file or instruction rows, with samples before and after.

Loads pretrained weights (--init: a hub id such as gpt2, a local transformers directory, or a
checkpoint / run directory of pretrain_shakespeare.py), adds LoRA adapters with minlora, trains
only them in the precision you choose (--precision fp16 uses dynamic loss scaling, bf16 needs
no scaling; fp32 on CPU), prints samples before and after, and saves the adapter
(<out-dir>/adapter). Optionally writes the adapter in PEFT format (--peft-export) and a merged
transformers model (--merge-export).

    python examples/finetune_lora.py --init gpt2 --data my_text.txt --precision bf16
    python examples/finetune_lora.py --init gpt2 --merge-export runs/lora/merged --peft-export runs/lora/peft
    python examples/sample.py --model gpt2 --adapter runs/lora/adapter --prompt "ROMEO:"

Instruction fine-tuning: --data a .jsonl file of {"instruction", "input", "output"} or
{"prompt", "response"} rows (loss on the responses only; docs/lora.md, "Instruction
fine-tuning"); --full trains every weight instead of LoRA:

    python examples/finetune_lora.py --init runs/shakespeare --data examples/data/instructions.jsonl --full \
        --max-lr 2e-3 --micro-batch-size 8 --max-steps 150 --out-dir runs/instruct
    python examples/sample.py --model runs/instruct --instruction "What do bees make?" --temperature 0

This script is `gpt2 finetune`.
"""

import sys

from gpt2.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("finetune", prog="finetune_lora.py", description=__doc__))
