"""Pipeline-parallel prefill: the decoder layers split over S stage processes (`engine.pipeline_stages`).

Design notes: docs/internals.md, section `tiered/hybrid/pipeline/__init__.py`.
"""

from tiered.hybrid.pipeline.coordinator import PipelineRunner, PipelineStartError, start_pipeline
from tiered.hybrid.pipeline.split import cut_microbatches, stage_layers

__all__ = ["PipelineRunner", "PipelineStartError", "cut_microbatches", "stage_layers", "start_pipeline"]
