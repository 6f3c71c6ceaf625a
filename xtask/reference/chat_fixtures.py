"""Makes the chat fixtures of kiln's tests: three chat templates of different shapes rendered
and tokenized by `transformers`' `apply_chat_template` on 50 conversations, and a tiny Llama
checkpoint with a chat template whose next-token loss `transformers` computes with the labels
-100 everywhere but the answers.

    pip install torch transformers tokenizers safetensors jinja2 pyarrow
    python3 xtask/reference/chat_fixtures.py --tokenizer tests/fixtures/hf/tokenizer/tokenizer.json \
        --text data/text/moby-dick.txt --out tests/fixtures/chat

writes, under --out:
    tokenizer.json           the fixtures' byte-level BPE (vocabulary 384) with seven special
                             tokens added (ids 384-390) that the templates use
    turns/, headers/, inst/  one tokenizer_config.json each (chat_template, bos_token,
                             eos_token; written in the three forms checkpoints use: a string,
                             an added-token object, a list of named templates)
    conversations.jsonl      50 conversations ({"messages": [{role, content}]}): with a
                             system message or not, one to four exchanges, some ending on the
                             user (rendered with the generation prompt), two that do not
                             alternate (the inst template refuses them); contents cut from
                             the text with spaces and new lines at their ends
    reference.json           per template and conversation: the token ids
                             apply_chat_template(tokenize=True) gives, or the error it raises
    llama-chat/              LlamaForCausalLM of vocabulary 391 with the `turns` template:
                             config.json, model.safetensors, tokenizer.json,
                             tokenizer_config.json, and reference.json: for 6 conversations
                             their ids, the labels (the tokens of every assistant turn, from
                             the end of the prompt that precedes it with the generation
                             prompt to the end of the turn; -100 elsewhere) and the loss
                             transformers computes with them, and the loss of the 6 as one
                             batch padded on the right (attention mask 0 and label -100 on
                             the padding)

and, made by pyarrow (`datasets` writes its Parquet files with it):
    pairs.parquet            8 prompt-and-answer rows (Alpaca's fields, Snappy-compressed, two
                             row groups), the sixth without its `output`
    chat.parquet             the first 6 conversations as rows of a `messages` list of
                             {role, content} structs (zstd-compressed)

The labels are taken from token counts of renders of the conversation's prefixes; the script
checks that each prefix's ids are the first ids of the whole conversation's (a template and
tokenizer for which they are not would make "the answer's tokens" ambiguous).
"""

import argparse
import json
import os
import random
import shutil

import torch
from tokenizers import AddedToken, Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|header|>", "<|end_header|>",
           "<|eot|>"]

# A system message of its own or a default one; every turn between start and end markers.
TURNS = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = 'You answer questions about old books.' -%}"
    "{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}"
    "{%- for m in rest -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The beginning-of-sequence token first, headers naming the role, contents trimmed.
HEADERS = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|header|>' + m.role + '<|end_header|>\\n\\n' + (m.content | trim) + '<|eot|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|header|>assistant<|end_header|>\\n\\n' -}}"
    "{%- endif -%}"
)

# The system message folded into the first user turn, roles that must alternate (an error
# raised otherwise), Python's str.strip(), the end-of-sequence token after each answer.
INST = (
    "{%- if messages[0].role == 'system' -%}"
    "{%- set sys = messages[0].content.strip() + '\\n\\n' -%}{%- set msgs = messages[1:] -%}"
    "{%- else -%}{%- set sys = '' -%}{%- set msgs = messages -%}{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for m in msgs -%}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') -}}"
    "{%- endif -%}"
    "{%- if m.role == 'user' -%}"
    "{{- '[INST] ' + (sys if loop.first else '') + m.content.strip() + ' [/INST]' -}}"
    "{%- else -%}{{- ' ' + m.content.strip() + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)

TEMPLATES = {
    # name: (template, bos, eos, how tokenizer_config.json spells them)
    "turns": (TURNS, None, "<|im_end|>", "string"),
    "headers": (HEADERS, "<s>", "<|eot|>", "added-token"),
    "inst": (INST, "<s>", "</s>", "list"),
}


def tokenizer_config(name):
    template, bos, eos, form = TEMPLATES[name]
    token = (lambda t: {"__type": "AddedToken", "content": t, "lstrip": False,
                        "normalized": False, "rstrip": False, "single_word": False,
                        "special": True}) if form == "added-token" else (lambda t: t)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
        "eos_token": token(eos),
        "chat_template": [{"name": "default", "template": template}] if form == "list"
        else template,
    }
    if bos is not None:
        config["bos_token"] = token(bos)
    return config


def hf_tokenizer(tok_file, name):
    template, bos, eos, _ = TEMPLATES[name]
    return PreTrainedTokenizerFast(tokenizer_file=tok_file, bos_token=bos, eos_token=eos,
                                   chat_template=template, clean_up_tokenization_spaces=False)


def piece(text, rng):
    """A slice of the text of 10 to 160 characters, sometimes with spaces or new lines at its
    ends."""
    n = rng.randint(10, 160)
    start = rng.randrange(0, len(text) - n)
    s = text[start:start + n]
    r = rng.random()
    if r < 0.15:
        s = "  " + s + "\n"
    elif r < 0.3:
        s = "\n" + s + " "
    return s


def conversations(text, count=50, seed=7):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": piece(text, rng)})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": piece(text, rng)})
            messages.append({"role": "assistant", "content": piece(text, rng)})
        if rng.random() < 0.3:
            # Ends on the user: rendered with the generation prompt.
            messages.append({"role": "user", "content": piece(text, rng)})
        if i in (17, 41):
            # Two users in a row: the inst template refuses it.
            at = 1 if messages[0]["role"] == "system" else 0
            messages.insert(at, {"role": "user", "content": piece(text, rng)})
        out.append({"messages": messages})
    return out


def ids_of(tok, messages, generation):
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def labels_of(tok, messages):
    """The ids of a whole conversation and its labels: each assistant turn's tokens, -100
    elsewhere."""
    ids = ids_of(tok, messages, False)
    labels = [-100] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = ids_of(tok, messages[:i], True)
        end = ids_of(tok, messages[:i + 1], False)
        assert ids[:len(start)] == start and ids[:len(end)] == end, \
            "a prefix's ids are not the conversation's first ids"
        labels[len(start):len(end)] = ids[len(start):len(end)]
    return ids, labels


def make_model(tok_file, out, convs):
    vocab = 384 + len(SPECIAL)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=386, eos_token_id=385,
                         tie_word_embeddings=False, attention_bias=False)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.config._attn_implementation = "eager"
    model.eval()
    if os.path.exists(out):
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    shutil.copy(tok_file, out)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config("turns"), f, indent=2)
    tok = hf_tokenizer(tok_file, "turns")
    picked = [c["messages"] for c in convs if c["messages"][-1]["role"] == "assistant"][:6]
    rows = []
    with torch.no_grad():
        for messages in picked:
            ids, labels = labels_of(tok, messages)
            loss = model(torch.tensor([ids]), labels=torch.tensor([labels])).loss
            rows.append({"messages": messages, "ids": ids, "labels": labels,
                         "loss": float(loss)})
        longest = max(len(r["ids"]) for r in rows)
        pad = lambda xs, v: xs + [v] * (longest - len(xs))
        ids = torch.tensor([pad(r["ids"], 385) for r in rows])
        labels = torch.tensor([pad(r["labels"], -100) for r in rows])
        mask = torch.tensor([pad([1] * len(r["ids"]), 0) for r in rows])
        batch = model(ids, attention_mask=mask, labels=labels).loss
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"conversations": rows, "batch_loss": float(batch)}, f)
    print(f"llama-chat: {len(rows)} conversations, batch loss {float(batch):.6f}")


def make_parquet(out, convs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"instruction": f"Name the number after {i}.", "input": "" if i % 2 else "in words",
             "output": str(i + 1)} for i in range(8)]
    rows[5] = {"instruction": "No answer here.", "input": "", "output": None}
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(out, "pairs.parquet"),
                   compression="snappy", row_group_size=4)
    pq.write_table(pa.Table.from_pylist(convs[:6]), os.path.join(out, "chat.parquet"),
                   compression="zstd")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = Tokenizer.from_file(args.tokenizer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok_file = os.path.join(args.out, "tokenizer.json")
    tok.save(tok_file)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()[:200_000]
    convs = conversations(text)
    with open(os.path.join(args.out, "conversations.jsonl"), "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    reference = {}
    for name in TEMPLATES:
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config(name), f, indent=2)
        hf = hf_tokenizer(tok_file, name)
        rows = []
        for c in convs:
            m = c["messages"]
            generation = m[-1]["role"] == "user"
            try:
                rows.append({"generation": generation, "ids": ids_of(hf, m, generation)})
            except Exception as e:  # the template's own raise_exception
                rows.append({"generation": generation, "error": str(e)})
        errors = sum("error" in r for r in rows)
        print(f"{name}: {len(rows)} conversations, {errors} refused")
        reference[name] = rows
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(reference, f)
    make_model(tok_file, os.path.join(args.out, "llama-chat"), convs)
    make_parquet(args.out, convs)


if __name__ == "__main__":
    main()
