"""Who paints a study's synthetic tumors (a light module: the command line reads it without loading torch).

- ``synthx``: the SynthX diffusion generator (:mod:`synthx.generation.painting`), trained in the study;
- ``phantom``: the embedded phantom's own renderer, the study's positive control
  (:mod:`synthx.generation.phantom_painter`).
"""

SYNTHX_PAINTER = "synthx"
PHANTOM_PAINTER = "phantom"
PAINTERS = (SYNTHX_PAINTER, PHANTOM_PAINTER)

__all__ = ["PAINTERS", "PHANTOM_PAINTER", "SYNTHX_PAINTER"]
