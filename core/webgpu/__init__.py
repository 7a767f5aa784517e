"""The WebGPU executor and its WGSL lowering, shared by desktop and browser."""
