"""Every probe has one home here: its device function, the layout of the vector it adds to
the step, its decoder, and the hook or call that measures it.

==============  =================================================================
module          what it measures (catalog names; tier from the catalog)
==============  =================================================================
loss            loss.sum / loss.tokens, by source (every step)
grads           grad.norm_sq, grad.clipped, per-group grad.* detail (every step)
head            output.logits_* (every step), output.top2_* (scan)
system          step time, FLOPs, memory peaks, guard counters; telemetry (every step)
comm            comm.wait_s / calls / bytes per collective (every step)
tensors         tensor.* of activations, gradients, parameters, updates (scan),
                kurtosis moments and the AdamW chain (on demand)
experts         moe.expert_tokens (every step), router bias and margins (on demand)
residual        residual.* branch scale, importance, angle, no-op, gates (scan)
modality        modality.tokens (every step), media scale and S_enc parts (scan)
attention       attn.*: the BOS value gradient (scan)
mtp             output.mtp_*: MTP top-1 agreement (scan)
modules         module.*: per-role gradient and activation views (on demand)
structure       installs the structure probes above on what ``discover`` found
==============  =================================================================

``common``, ``tokens`` and ``layout`` hold what several homes share.
"""
