"""What the machine is: device and dtype names, host-to-device staging (devices.py), and what the
CPU computes natively and how its threads are split (cpu_features.py). A leaf under every engine
layer: models, native and checkpoints use it."""
