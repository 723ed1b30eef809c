"""Every probe's device function reads no data on the host: run on meta tensors, which carry
no data, any .item(), .cpu() or boolean-mask indexing would raise."""

from __future__ import annotations

import torch

from probewire.instrument.probes.experts import expert_token_counts, topk_margin
from probewire.instrument.probes.grads import grad_norms
from probewire.instrument.probes.head import output_head, output_top2
from probewire.instrument.probes.loss import loss_components
from probewire.instrument.probes.modality import (
    encoder_grad_share_components,
    media_scale_components,
)
from probewire.instrument.probes.mtp import mtp_top1_agreement
from probewire.instrument.probes.residual import gate_saturation, residual_token_values
from probewire.instrument.probes.tokens import token_quantiles


def test_device_side_functions_read_no_data_on_the_host() -> None:
    m = "meta"
    valid = torch.ones(50, dtype=torch.bool, device=m)
    x, y = torch.empty(50, 16, device=m), torch.empty(50, 16, device=m)
    logits = torch.empty(50, 100, device=m, dtype=torch.bfloat16)
    outputs = [
        token_quantiles(residual_token_values(x, y, chunk_elems=200), valid),
        gate_saturation(x, valid, thresholds=(0.05, 0.1)),
        expert_token_counts(torch.empty(50, 2, dtype=torch.long, device=m), valid, 8),
        token_quantiles(topk_margin(x, 2), valid),
        *output_head(logits, valid)[0],
        output_top2(logits, valid),
        mtp_top1_agreement(logits, logits, valid),
        media_scale_components(x[:3], y, text_valid=valid),
        encoder_grad_share_components([x], [y]),
        *loss_components(x, valid.reshape(50, 1).expand(50, 16), [], 0)[0],
        grad_norms([x, y], None),
    ]
    assert all(out.device.type == "meta" for out in outputs)
