"""Sample text from GPT-2, streaming tokens as they are generated.

--model is a hub id (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a transformers directory, or a
checkpoint / run directory of pretrain_shakespeare.py; --adapter adds a LoRA adapter
(finetune_lora.py's <out-dir>/adapter, or a PEFT adapter directory).

    python examples/sample.py --prompt "Hello, I'm a language model," -n 3 --seed 42
    python examples/sample.py --model runs/shakespeare --prompt "ROMEO:" --temperature 0.8 --top-k 200
    python examples/sample.py --model gpt2 --adapter runs/lora/adapter --top-p 0.9
    python examples/sample.py --model runs/instruct --instruction "Add the two numbers." --input "7 and 5"

--instruction (with the optional --input) samples the response of a model fine-tuned on
instruction rows: the prompt is the template of docs/lora.md and only the response is printed.

This script is `gpt2 sample`.
"""

import sys

from gpt2.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("sample", prog="sample.py", description=__doc__))
