"""Diffusers-style speculative pipelines (imported as `mmspec.pipelines`)."""
