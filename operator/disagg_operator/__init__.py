"""disagg operator: reconciles DisaggregatedPipeline resources (kopf). Never imports torch."""
