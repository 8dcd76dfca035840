"""GGUF files from `dockyard export gguf` run in llama.cpp (llama-cpp-python) and give transformers' logits.

    models: a tiny llama (untied head) and a tiny qwen2 (tied embeddings, q/k/v biases), random init with
            --init-std (default 0.1, so the next-token distribution is not flat), the character tokenizer,
            saved as Hugging Face folders
    for each model and each --types (default f32 f16 q8_0):
        dockyard.export.gguf_export.export(folder, out, type) ──llama_cpp.Llama(out, logits_all)──>
        eval the same 48 token ids ──> every position's logits against transformers' (float32)
Prints, per model and type, the largest |Δ logit| relative to the logits' spread, and the fraction of
positions whose argmax agrees; then
    gguf_<type>_max_rel_logit_error: E   (over both models; f32 differs only by llama.cpp's f16 KV cache and
                                         summation order, E of order 1e-3; a wrong tensor layout gives E ~ 1)
    gguf_<type>_argmax_agreement: A      (f32, f16: 1.0; q8_0 also quantizes activations in llama.cpp)
llama-cpp-python has no wheel on PyPI (its sdist compiles llama.cpp: about 30 minutes on a loaded
2-core machine), so this check lives here rather than in the test suite. k-quants go through
llama.cpp's llama-quantize (DOCKYARD_LLAMA_CPP_DIR, e.g. the sdist's vendor/llama.cpp with
`cmake -B build && cmake --build build --target llama-quantize`).

    pip install llama-cpp-python diskcache && python bench/gguf_logits.py
    DOCKYARD_LLAMA_CPP_DIR=... python bench/gguf_logits.py --hidden 256 --types f16 q6_k q4_k_m
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    parser.add_argument("--init-std", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (k-quants need rows of 256: --hidden 256)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np
    import torch
    from llama_cpp import Llama

    from dockyard.export.gguf_export import export
    from dockyard.models.build import build_random_model
    from dockyard.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = tok("def f(x):\n    return 2*x + 1\n\nassert f(3) == 7  # ok")["input_ids"][:48]
    worst: dict[str, float] = {}
    agree: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, tied in (("llama", False), ("qwen2", True)):
            config = {"model_type": model_type, **SHAPE, "initializer_range": args.init_std}
            config.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden)
            config["tie_word_embeddings"] = tied
            model = build_random_model(
                config, len(tok), 0,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
            ).eval()  # fmt: skip
            folder = Path(tmp) / model_type
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            with torch.no_grad():
                reference = model(torch.tensor([ids])).logits[0].float().numpy()
            spread = float(reference.std())
            for type_name in args.types:
                out = Path(tmp) / f"{model_type}.{type_name}.gguf"
                export(folder, out, type_name)
                llm = Llama(str(out), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
                llm.eval(ids)
                logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
                rel = float(np.abs(logits - reference).max() / spread)
                match = float((logits.argmax(-1) == reference.argmax(-1)).mean())
                print(f"{model_type} {type_name}: max |Δ logit| / std = {rel:.2e}, argmax agreement {match:.3f}")
                worst[type_name] = max(worst.get(type_name, 0.0), rel)
                agree[type_name] = min(agree.get(type_name, 1.0), match)
                llm.close()
    for type_name in args.types:
        print(f"gguf_{type_name}_max_rel_logit_error: {worst[type_name]:.3e}")
        print(f"gguf_{type_name}_argmax_agreement: {agree[type_name]:.3f}")


if __name__ == "__main__":
    main()
