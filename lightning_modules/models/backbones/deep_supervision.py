"""One deep-supervision contract for every backbone: a list of logits in train mode, one tensor in eval mode.

Libraries disagree: dynamic-network-architectures' ``UNetDecoder`` returns a list in both modes
while its ``deep_supervision`` flag is on, and MONAI's ``MedNeXt`` returns a tuple in train mode
and one tensor in eval mode. :class:`DeepSupervisionOutput` wraps either so that the
SegmentationModule sees ``[full, half, quarter, ...]`` (full resolution first) while training and
only the full-resolution logits in evaluation and sliding-window inference.

Example::

    net = DeepSupervisionOutput(plain_conv_unet, set_deep_supervision=decoder_flag)
    net.train(); outputs = net(x)   # list, outputs[0] has x's spatial shape
    net.eval(); logits = net(x)     # tensor
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class DeepSupervisionOutput(nn.Module):
    """Wrap a network with deep-supervision heads so its outputs follow the registry contract.

    Args:
        network: the wrapped network; it returns a sequence of logits (full resolution first) when
            its deep-supervision heads are active, a tensor otherwise.
        set_deep_supervision: called with ``(network, training)`` whenever the mode changes, for
            networks that compute their heads behind a flag (skipping the heads in eval mode saves
            time and memory); ``None`` for networks that follow ``self.training`` themselves.
    """

    def __init__(
        self,
        network: nn.Module,
        set_deep_supervision: Callable[[nn.Module, bool], None] | None = None,
    ):
        super().__init__()
        self.network = network
        self._set_deep_supervision = set_deep_supervision
        if set_deep_supervision is not None:
            set_deep_supervision(network, self.training)

    def train(self, mode: bool = True) -> "DeepSupervisionOutput":
        super().train(mode)
        if self._set_deep_supervision is not None:
            self._set_deep_supervision(self.network, mode)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        outputs = self.network(x)
        if self.training:
            if isinstance(outputs, torch.Tensor):
                raise RuntimeError(
                    f"{type(self.network).__name__} returned one tensor in train mode; "
                    "its deep-supervision heads are off"
                )
            return list(outputs)
        if isinstance(outputs, (list, tuple)):
            return outputs[0]
        return outputs
