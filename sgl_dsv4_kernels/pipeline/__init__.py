"""End-to-end driver of one attention layer's KV side (issue 7): ``KVLayer`` runs the metadata, sliding-window
K write, compressor, compressed / indexer cache stores and paged-MQA schedule of a step; ``RequestPool`` is the
host bookkeeping; ``run_session`` drives layers through a scripted serving session beside the pure-torch model
``sgl_dsv4_kernels.reference.pipeline.ReferenceLayer``.
"""
from .kinds import KIND_SPECS, LayerKind
from .layer import DecodeGraph, KVLayer, LayerCaches, LayerRows, LayerWeights, StepMetadata, StepResult
from .pool import PoolGeometry, RequestPool, StepBatch, StepInputs
from .scenario import Action, Scenario, default_schedule
from .session import StepReport, run_session

__all__ = [
    "LayerKind", "KIND_SPECS", "KVLayer", "DecodeGraph", "LayerCaches", "LayerRows", "LayerWeights",
    "StepMetadata", "StepResult", "PoolGeometry", "RequestPool", "StepBatch", "StepInputs", "Action",
    "Scenario", "default_schedule", "StepReport", "run_session",
]
