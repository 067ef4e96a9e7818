"""``opgrad export-onnx CKPT OUT.onnx``: an opgrad checkpoint (architecture + weights) as ONNX."""

from __future__ import annotations

import argparse

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``opgrad export-onnx``'s options to ``parser``."""
    parser.add_argument("checkpoint", metavar="CKPT", help="an opgrad checkpoint (.npz) with a model description")
    parser.add_argument("output", metavar="OUT", help="the ONNX file to write (opset 17; 20 where the model uses GELU)")


def run(args: argparse.Namespace) -> int:
    from opgrad.nn import load_model
    from opgrad.onnx import save
    from opgrad.train import check_output

    check_output(args.output, "OUT", {"CKPT": args.checkpoint})  # a user error (status 2) before the checkpoint is read
    model = load_model(args.checkpoint)
    save(model, args.output)
    print(f"wrote {args.output}: model {model.name!r}, {model.num_params:,} parameters, inputs "
          f"{', '.join('(N, ' + ', '.join(map(str, s)) + ')' for s in model.input_shapes)}")
    return 0
