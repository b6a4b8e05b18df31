"""Engine-neutral interface and the reference PyTorch engine."""
