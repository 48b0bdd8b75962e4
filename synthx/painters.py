"""Who paints a study's synthetic tumors (a light module: the command line reads it without loading torch).

- ``synthx``: the SynthX diffusion generator (:mod:`synthx.generation.painting`), trained in the study;
- ``phantom``: the embedded phantom's own renderer, the study's positive control
  (:mod:`synthx.generation.phantom_painter`);
- ``copy_paste``: real training tumors cut out with their masks and pasted at the sites SynthX
  paints (:mod:`synthx.generation.copy_paste`): SynthX's canvases and placement without its content.
"""

SYNTHX_PAINTER = "synthx"
PHANTOM_PAINTER = "phantom"
COPY_PASTE_PAINTER = "copy_paste"
PAINTERS = (SYNTHX_PAINTER, PHANTOM_PAINTER, COPY_PASTE_PAINTER)

__all__ = ["COPY_PASTE_PAINTER", "PAINTERS", "PHANTOM_PAINTER", "SYNTHX_PAINTER"]
