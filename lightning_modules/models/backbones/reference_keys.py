"""Reference implementations' state-dict keys renamed to this package's modules, one function per
backbone whose module names differ from its reference: MedNeXt, STU-Net, the Universal Model and
VSmTrans. A reference checkpoint loads after renaming its keys; ``tests/models/test_reference_outputs.py``
checks the outputs against the reference's on those weights, and ``tests/fixtures/make_reference_fixtures.py``
remakes the fixtures.

Example::

    network.load_state_dict({stunet_key(k): v for k, v in reference["state_dict"].items()}, strict=True)
"""

from __future__ import annotations


def mednext_key(key: str, n_stages: int = 4) -> str:
    """A key of the reference's state dict (``enc_block_0.1.conv1.weight``...) renamed to this module's.

    The reference numbers decoder stages by depth (``up_3`` is the first to run); MONAI numbers
    them in the order they run.
    """
    head, _, rest = key.partition(".")
    kind, _, index = head.rpartition("_")
    if kind == "enc_block":
        return f"enc_stages.{index}.{rest}"
    if kind == "down":
        return f"down_blocks.{index}.{rest}"
    if kind == "up":
        return f"up_blocks.{n_stages - 1 - int(index)}.{rest}"
    if kind == "dec_block":
        return f"dec_stages.{n_stages - 1 - int(index)}.{rest}"
    if kind == "out" and index != "0":
        return f"out_blocks.{n_stages - int(index)}.{rest}"
    return key


_REFERENCE_NAMES = (
    ("conv_blocks_context.", "encoder."),
    ("conv_blocks_localization.", "decoder."),
    ("upsample_layers.", "upsamplers."),
    ("seg_outputs.", "heads."),
    (".conv3.", ".shortcut."),
)


def stunet_key(key: str) -> str:
    """A key of the reference implementation's state dict, renamed to this module's."""
    for old, new in _REFERENCE_NAMES:
        key = key.replace(old, new)
    return key


# The reference's module names -> the module's (its state dict loads after renaming with universal_model_key).
_REFERENCE_LEVELS = {"down_tr64": "encoder.0", "down_tr128": "encoder.1", "down_tr256": "encoder.2", "down_tr512": "encoder.3"}
_REFERENCE_UP = {"up_tr256": "0", "up_tr128": "1", "up_tr64": "2"}
_REFERENCE_HEADS = (
    ("precls_conv.", "head_input."),
    ("GAP.", "image_branch."),
    ("organ_embedding.weight", "class_embeddings.weight"),  # rand_embedding: a learned nn.Embedding
    ("text_to_vision.", "text_branch."),
)


def universal_model_key(key: str) -> str:
    """A key of the reference ``Universal_model``'s state dict (either backbone), renamed to this module's.

    The word-embedding buffer ``organ_embedding`` (a tensor, not an ``nn.Embedding``) becomes
    ``text_embeddings``.
    """
    if key == "organ_embedding":
        return "text_embeddings"
    if key.startswith("backbone.swinViT.") or key.startswith("backbone.encoder") or key.startswith("backbone.decoder"):
        return "backbone.net." + key[len("backbone."):]
    for old, new in _REFERENCE_LEVELS.items():  # ops.<layer>.conv1 / .bn1 -> encoder.<level>.<layer>.0 / .1
        if key.startswith(f"backbone.{old}.ops."):
            rest = key[len(f"backbone.{old}.ops."):]
            return f"backbone.{new}." + rest.replace(".conv1.", ".0.").replace(".bn1.", ".1.")
    for old, index in _REFERENCE_UP.items():
        if key.startswith(f"backbone.{old}.up_conv."):
            return f"backbone.upsamplers.{index}." + key[len(f"backbone.{old}.up_conv."):]
        if key.startswith(f"backbone.{old}.ops."):
            rest = key[len(f"backbone.{old}.ops."):]
            return f"backbone.decoder.{index}." + rest.replace(".conv1.", ".0.").replace(".bn1.", ".1.")
    for old, new in _REFERENCE_HEADS:
        if key.startswith(old):
            return new + key[len(old):]
    return key


# The reference's names inside one block (after ``VSmViT.layers<i>.0.blocks.<j>.``) -> the module's.
_REFERENCE_BLOCK_NAMES = (
    ("attn.rate1", "mixer.alpha"),  # the reference's (1,)-shaped scalars; the module's are 0-dimensional
    ("attn.rate2", "mixer.beta"),
    ("attn.qkv.", "mixer.qkv."),
    ("attn.proj.", "mixer.proj."),
    ("attn.conv1.", "mixer.fuse.1."),
    ("attn.norm1.", "mixer.fuse.2."),
    ("attn.dep_conv.", "mixer.conv.0."),
    ("attn.norm2.", "mixer.conv.1."),
    ("mlp.fc1.", "mlp.linear1."),
    ("mlp.fc2.", "mlp.linear2."),
)


def vsmtrans_key(key: str) -> str | None:
    """A key of the reference ``VSmixTUnet``'s state dict, renamed to this module's; ``None`` for the
    reference's entries with no counterpart here (the unused fifth deep-supervision head ``out_4`` and
    the relative-position index buffers, which this module computes). ``rate1``/``rate2`` have shape
    (1,) there and () here."""
    parts = key.split(".")
    if key.startswith("VSmViT.patch_embed."):
        return key[len("VSmViT."):]
    if key.startswith("VSmViT.layers"):
        stage = int(parts[1][len("layers"):]) - 1
        if parts[2] == "1":  # the stage's patch merging
            return f"mergers.{stage}." + ".".join(parts[3:])
        rest = ".".join(parts[5:])
        if rest.endswith("relative_position_index"):
            return None
        if rest.startswith("attn.attns.") and rest.endswith("relative_position_bias_table"):
            return f"stages.{stage}.{parts[4]}.mixer.attentions.{parts[7]}.relative_position_bias"
        for old, new in _REFERENCE_BLOCK_NAMES:
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        return f"stages.{stage}.{parts[4]}.{rest}"
    if parts[0] == "out_4":
        return None
    if parts[0].startswith("out_"):
        return f"deep_heads.{int(parts[0][4:])}.conv.conv." + ".".join(parts[1:])
    for prefix, first, rest_name in (("encoder", "encoder0", "encoders"), ("decoder", "decoder0", "decoders")):
        if parts[0].startswith(prefix) and parts[0][len(prefix):].isdigit():
            index = int(parts[0][len(prefix):])
            head = first if index == 1 else f"{rest_name}.{index - 2}"
            return ".".join([head, *parts[1:]])
    return key


__all__ = ["mednext_key", "stunet_key", "universal_model_key", "vsmtrans_key"]
