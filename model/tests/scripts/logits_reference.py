#!/usr/bin/env python3
"""Makes the logits parity fixture (model/tests/fixtures/logits/) with an independent
implementation: Hugging Face transformers loading the same GGUF file, float32 on the CPU.

Run on a machine with torch + transformers + gguf (the device machine; see
model/tests/scripts/logits_device.sh):
    python3 logits_reference.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR

Writes DIR/reference.json (prompt texts, input ids, 64 greedy ids, top-1/top-2 margins) and
DIR/last_logits.f32 (little-endian float32, [n_prompts, vocab]: logits at each prompt's last
position). The C++ test (model/tests/logits_parity_test.cc) feeds the same input ids, so the
comparison isolates the forward pass from the tokenizer.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

N_GREEDY = 64

LONG_TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. In the "
    "nineteenth century, Charles Babbage designed the Analytical Engine, a mechanical "
    "general-purpose computer that was never completed in his lifetime, while Ada Lovelace "
    "wrote what is often described as the first algorithm intended to be carried out by such "
    "a machine. A century later, Alan Turing formalised the notion of computation itself with "
    "his abstract machine, and John von Neumann described the stored-program architecture "
    "that still shapes most processors today. The transistor, invented at Bell Labs in 1947, "
    "replaced fragile vacuum tubes, and the integrated circuit packed many transistors onto a "
    "single chip of silicon. Moore's observation that the number of transistors on a chip "
    "doubled roughly every two years held for decades and drove an exponential growth in "
    "computing power. Operating systems grew from simple batch monitors into time-sharing "
    "systems such as Multics and Unix, which introduced ideas like hierarchical file systems, "
    "processes and pipes. Programming languages evolved from machine code and assembly to "
    "FORTRAN, COBOL, Lisp, C and eventually to the high-level languages used by millions of "
    "developers today. Networks connected these machines: ARPANET became the Internet, and "
    "the World Wide Web, proposed by Tim Berners-Lee in 1989, turned it into a medium for "
    "everyone. Today, large language models trained on vast collections of text run on "
    "clusters of accelerators, and serving them efficiently raises new questions about "
    "memory, bandwidth and scheduling. In summary, the key lesson of this history is that"
)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_default_dtype(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    folder, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    print("transformers", transformers.__version__, "torch", torch.__version__)
    print(model.config)

    # SmolLM2 has no output.weight: the output projection is the token embedding. Make sure the
    # loader tied them rather than leaving a random lm_head.
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if not torch.equal(emb, head):
        print("WARNING: lm_head was not tied to the embedding; tying it explicitly")
        with torch.no_grad():
            model.get_output_embeddings().weight = emb

    chat_messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    try:
        chat_text = tok.apply_chat_template(chat_messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the GGUF tokenizer may come without a template
        print("apply_chat_template failed:", e)
        chat_text = None
    chatml = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
              "Face<|im_end|>\n<|im_start|>user\n" + chat_messages[0]["content"] +
              "<|im_end|>\n<|im_start|>assistant\n")
    if chat_text != chatml:
        print("chat template gave", repr(chat_text), "; using the chatml text", repr(chatml))
        chat_text = chatml

    prompts = [
        ("plain", "The capital of France is"),
        ("chat", chat_text),
        ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        ("long", LONG_TEXT),
    ]

    records = []
    last_logits = []
    with torch.no_grad():
        for name, text in prompts:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            x = torch.tensor([ids], dtype=torch.long)
            out = model(input_ids=x, use_cache=True)
            logits = out.logits[0].float()  # [n_tokens, vocab]
            last_logits.append(logits[-1].numpy().astype("<f4"))
            # Top-8 at a few earlier positions, to localise a mismatch if one appears.
            checkpoints = []
            for pos in sorted(set([0, len(ids) // 2, len(ids) - 1])):
                values, indices = torch.topk(logits[pos], 8)
                checkpoints.append({"position": pos, "top_ids": indices.tolist(),
                                    "top_logits": values.tolist()})
            past = out.past_key_values
            step_logits = logits[-1]
            greedy, margins = [], []
            for _ in range(N_GREEDY):
                top2 = torch.topk(step_logits, 2)
                next_id = int(top2.indices[0])
                greedy.append(next_id)
                margins.append(float(top2.values[0] - top2.values[1]))
                out = model(input_ids=torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                step_logits = out.logits[0, -1].float()
            records.append({"name": name, "text": text, "input_ids": ids, "greedy_ids": greedy,
                            "greedy_text": tok.decode(greedy), "greedy_margins": margins,
                            "checkpoints": checkpoints})
            print(f"[{name}] {len(ids)} tokens; min greedy margin {min(margins):.4f}")
            print("   ", repr(tok.decode(greedy)))

    os.makedirs(args.out, exist_ok=True)
    np.stack(last_logits).tofile(os.path.join(args.out, "last_logits.f32"))
    meta = {"model_file": os.path.basename(args.gguf),
            "vocab": int(last_logits[0].shape[0]), "prompts": records}
    meta["source"] = "transformers %s / torch %s, float32 on CPU, loading %s" % (
        transformers.__version__, torch.__version__, os.path.basename(args.gguf))
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
