"""Asks a Hugging Face export of kiln's the questions kiln answered, with `transformers`, and
compares the greedy answers: the check that a fine-tuned run's export gives kiln's answers.

    pip install torch transformers tokenizers safetensors jinja2
    train answer --run runs/sotu-instruct --data data/sotu-instruct/eval.jsonl \
        --limit 10 --out runs/sotu-instruct/answers.jsonl
    python3 xtask/reference/sotu_answers.py --model runs/sotu-instruct/hf \
        --answers runs/sotu-instruct/answers.jsonl

For each line of --answers (`train answer --out`: prompt, expected, answer), the prompt as a
user's turn is rendered by the export's own chat template (`apply_chat_template` with the
generation prompt), the model continues it greedily (`generate(do_sample=False)`) until the
tokenizer's end-of-sequence token or --tokens new tokens, and the text of the new tokens
without that token is compared with kiln's answer. Prints each pair; exits 1 if any differ.
"""

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="the run's hf/ directory")
    p.add_argument("--answers", required=True, help="train answer --out FILE")
    p.add_argument("--tokens", type=int, default=64, help="train answer's --tokens")
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    eos = tokenizer.eos_token_id
    same = 0
    rows = [json.loads(line) for line in open(args.answers, encoding="utf-8") if line.strip()]
    for row in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        new = out[0, ids.shape[1]:].tolist()
        if new and new[-1] == eos:
            new = new[:-1]
        theirs = tokenizer.decode(new).strip()
        ok = theirs == row["answer"]
        same += ok
        print(f"{'same' if ok else 'DIFFERENT'}: kiln {row['answer']!r}, transformers {theirs!r}")
    print(f"{same} of {len(rows)} answers the same")
    sys.exit(0 if same == len(rows) else 1)


if __name__ == "__main__":
    main()
