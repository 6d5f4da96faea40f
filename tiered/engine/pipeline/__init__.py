"""Pipeline-parallel prefill: the decoder layers split over S stage processes (`engine.pipeline_stages`).

Design notes: docs/internals.md, section `tiered/engine/pipeline/__init__.py`.
"""

from tiered.engine.pipeline.coordinator import PipelineRunner, PipelineStartError, start_pipeline
from tiered.engine.pipeline.split import cut_microbatches, stage_layers

__all__ = ["PipelineRunner", "PipelineStartError", "cut_microbatches", "stage_layers", "start_pipeline"]
