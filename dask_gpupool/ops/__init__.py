"""Operations: Prometheus metrics and the scheduler's /gpupool page (what operators read)."""
