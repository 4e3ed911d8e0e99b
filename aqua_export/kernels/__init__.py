"""GPU kernels of the custom nodes (the CPU kernels are C++, plugins/ort)."""
