"""The operation types of a training trace (paper 004, Table 1) and how each is treated.

The vocabulary is Megatron-LM's as recorded by NDTimeline and released with the
StragglerAnalysis traces. Each op type has three properties the simulator needs:

* its *stream* on the worker (compute, one of the four PP streams, the DP
  communication stream, or the post-backward chain),
* whether it is a cross-rank *collective* whose recorded duration contains
  blocking time (only its transfer-duration is intrinsic, section 3.2),
* how its idealised duration is estimated: mean for computation (imbalance is
  re-balanced work), median for communication (rare very long transfers from
  flapping links would skew a mean).
"""

from __future__ import annotations

FORWARD_COMPUTE = "forward-compute"
BACKWARD_COMPUTE = "backward-compute"
FORWARD_SEND = "forward-send"
FORWARD_RECV = "forward-recv"
BACKWARD_SEND = "backward-send"
BACKWARD_RECV = "backward-recv"
PARAMS_ALL_GATHER = "params-all-gather"
GRADS_REDUCE_SCATTER = "grads-reduce-scatter"
SEPARATE_GRADS_ALL_REDUCE = "separate-grads-all-reduce"
EMBEDDING_GRADS_ALL_REDUCE = "embedding-grads-all-reduce"
LAYERNORM_GRADS_ALL_REDUCE = "layernorm-grads-all-reduce"
OPTIMIZER_CLIP_MAIN_GRAD = "optimizer-clip-main-grad"
OPTIMIZER = "optimizer"
GC = "gc"

COMPUTE = (FORWARD_COMPUTE, BACKWARD_COMPUTE)
P2P = (FORWARD_SEND, FORWARD_RECV, BACKWARD_SEND, BACKWARD_RECV)
# params-sync / grads-sync of the paper: collectives among the DP ranks of a stage.
DP_COMM = (PARAMS_ALL_GATHER, GRADS_REDUCE_SCATTER, SEPARATE_GRADS_ALL_REDUCE)

# After the last backward-compute each stage runs these, in this order.
POST_CHAIN = (
    GC,
    LAYERNORM_GRADS_ALL_REDUCE,
    EMBEDDING_GRADS_ALL_REDUCE,
    GRADS_REDUCE_SCATTER,
    SEPARATE_GRADS_ALL_REDUCE,
    OPTIMIZER_CLIP_MAIN_GRAD,
    OPTIMIZER,
)

KNOWN = frozenset(COMPUTE + P2P + DP_COMM + POST_CHAIN)

# Idealised with the median (communication); everything else with the mean.
# layernorm-grads-all-reduce is a TP/sequence-parallel all-reduce: communication,
# but inside the traced worker's TP group, so it has no cross-rank group here.
MEDIAN_IDEALISED = frozenset(
    P2P + DP_COMM + (EMBEDDING_GRADS_ALL_REDUCE, LAYERNORM_GRADS_ALL_REDUCE, OPTIMIZER_CLIP_MAIN_GRAD)
)

# Send and receive of one transfer are one cause (section 4.3 groups them):
# S_t is reported for these merged groups.
ATTRIBUTION_GROUP = {
    FORWARD_SEND: "forward-pp-comm",
    FORWARD_RECV: "forward-pp-comm",
    BACKWARD_SEND: "backward-pp-comm",
    BACKWARD_RECV: "backward-pp-comm",
}


def attribution_group(optype: str) -> str:
    """The S_t group an op type is reported under (PP send+recv merged)."""
    return ATTRIBUTION_GROUP.get(optype, optype)


# Peer of a PP op: (peer op type, stage offset of the peer).
P2P_PEER = {
    FORWARD_SEND: (FORWARD_RECV, +1),
    FORWARD_RECV: (FORWARD_SEND, -1),
    BACKWARD_SEND: (BACKWARD_RECV, -1),
    BACKWARD_RECV: (BACKWARD_SEND, +1),
}

# The compute op a PP op is bound to: a send follows the compute that produced
# the microbatch, a receive precedes the compute that consumes it.
P2P_COMPUTE = {
    FORWARD_SEND: FORWARD_COMPUTE,
    FORWARD_RECV: FORWARD_COMPUTE,
    BACKWARD_SEND: BACKWARD_COMPUTE,
    BACKWARD_RECV: BACKWARD_COMPUTE,
}
