"""``opgrad import MODEL --save ckpt.npz``: an ONNX or Keras model file -> an opgrad checkpoint.

The file type follows the suffix: ``.onnx`` is read by :func:`opgrad.onnx.load`, ``.keras``
and ``.h5`` by :func:`opgrad.keras.load`. The checkpoint holds the architecture and weights, so
``opgrad train --init``, ``opgrad predict``, ``opgrad export-onnx`` and ``nn.load`` take it.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from opgrad.errors import ConfigError, UserError

__all__ = ["IMPORTERS", "configure", "load_any", "run"]

#: suffix -> the module whose ``load(path)`` reads it.
IMPORTERS = {".onnx": "opgrad.onnx", ".keras": "opgrad.keras", ".h5": "opgrad.keras"}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``opgrad import``'s options to ``parser``."""
    parser.add_argument("model", metavar="MODEL", help="an ONNX (.onnx) or Keras (.keras, .h5) model file")
    parser.add_argument("--save", metavar="PATH", required=True, help="the opgrad checkpoint (.npz) to write")


def load_any(path: str, notes: list[str] | None = None) -> Any:
    """The ``opgrad.nn.Model`` in ``path``, read by the importer its suffix names; what the Keras
    importer notes on the conversion (a final softmax left out, ...) is added to ``notes``."""
    # Checked before the suffix, which a directory may have (d.onnx) or lack (/tmp).
    if Path(path).is_dir():
        raise ConfigError(f"{path}: is a directory, expected a model file ({', '.join(IMPORTERS)})")
    suffix = Path(path).suffix.lower()
    module_name = IMPORTERS.get(suffix)
    if module_name is None:
        raise ConfigError(f"{path}: unknown model file type {suffix or '(no suffix)'!r}; supported: "
                          f"{', '.join(IMPORTERS)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise ConfigError(f"{path}: this opgrad has no {suffix} importer ({module_name} is missing)") from None
        raise ConfigError(f"{path}: reading {suffix} files needs {exc.name}: pip install 'opgrad[interop]'") from None
    if not Path(path).is_file():
        raise ConfigError(f"{path}: no such file")
    if notes is not None and hasattr(module, "read"):
        imported = module.read(path)
        notes.extend(imported.notes)
        return imported.model
    return module.load(path)


def run(args: argparse.Namespace) -> int:
    from opgrad.train import check_output

    check_output(args.save, "--save", {"MODEL": args.model})
    if Path(args.save).suffix.lower() in IMPORTERS:
        raise ConfigError(f"--save {args.save}: writes an opgrad checkpoint, not a {Path(args.save).suffix} file; "
                          "name it .npz (opgrad export-onnx writes ONNX from a checkpoint)")
    notes: list[str] = []
    model = load_any(args.model, notes)
    try:
        model.save(args.save)
    except OSError as exc:
        raise UserError(f"--save {args.save}: {exc}") from None
    print(model.summary())
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.save}: {model.num_params:,} parameters from {args.model}")
    return 0
