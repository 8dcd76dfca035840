"""`dockyard export hf|gguf`: the command-line side of dockyard/export (argument handling only).

    dockyard export hf CHECKPOINT OUT                       HF folder from a (sharded) checkpoint
    dockyard export gguf HF_FOLDER OUT --type T [--type T]  validated GGUF file(s); several types: OUT is a folder

Exit status 0 when every output was written and validated, 1 when an export failed (the message
names the tensor, key or step), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys


def add_commands(sub) -> None:
    export = sub.add_parser("export", help="convert checkpoints: an HF folder, GGUF files").add_subparsers(
        dest="export_command", required=True
    )
    p = export.add_parser("hf", help="a Hugging Face folder from a checkpoint (sharded or HF)")
    p.add_argument("checkpoint", help="a checkpoint folder (step-<N>)")
    p.add_argument("out", help="the new folder to write")
    p.set_defaults(func=cmd_export_hf)
    p = export.add_parser("gguf", help="GGUF file(s) of a Hugging Face folder, validated with the gguf package")
    p.add_argument("folder", help="a Hugging Face model folder (e.g. from `dockyard export hf`)")
    p.add_argument("out", help="the .gguf file to write; with several --type, a folder of <name>.<type>.gguf")
    p.add_argument(
        "--type",
        dest="types",
        action="append",
        metavar="TYPE",
        help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 (the gguf package), or any llama-quantize type "
        "with --llama-cpp; repeat (or comma-separate) for several files; default f16",
    )
    p.add_argument("--llama-cpp", help="a llama.cpp checkout (default: DOCKYARD_LLAMA_CPP_DIR)")
    p.set_defaults(func=cmd_export_gguf)


def cmd_export_hf(args: argparse.Namespace) -> int:
    from dockyard.export.hf_export import ExportError, export_hf

    try:
        out = export_hf(args.checkpoint, args.out)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def cmd_export_gguf(args: argparse.Namespace) -> int:
    from dockyard.export.gguf_export import GgufError, export, export_many

    types = [t.strip().lower() for given in (args.types or ["f16"]) for t in given.split(",") if t.strip()]
    try:
        if len(types) == 1:
            results = {types[0]: (args.out, export(args.folder, args.out, types[0], args.llama_cpp))}
        else:
            results = export_many(args.folder, args.out, types, args.llama_cpp)
    except GgufError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for type_name, (path, notes) in results.items():
        print(f"wrote {path} ({type_name}, validated)")
        for note in notes:
            print(f"  note: {note}")
    return 0
