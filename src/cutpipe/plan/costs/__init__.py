"""What things cost: per-item times, memory and traffic from a model and a machine (hardware
presets, or a measured profile), and the model's calibration against published runs."""
