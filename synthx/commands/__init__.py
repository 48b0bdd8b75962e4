"""The SynthX ``benchx`` subcommands, one module each: argparse, printing and exit codes only.

``synthx_train`` (``benchx synthx-train``), ``synthesize`` and ``synthx_quality``; each ``main(argv)``
parses and calls one library function of :mod:`synthx`.
"""
