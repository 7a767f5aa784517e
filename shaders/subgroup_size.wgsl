enable subgroups;
// The invocations of one subgroup, measured: core/webgpu/device.py `GPUDevice.subgroup_size` runs
// this once per device (adapters report a range, e.g. 4..128 for NVIDIA's Vulkan driver through
// wgpu-native and Dawn, and llvmpipe's, which run 32 and 8). One workgroup of 128 invocations
// (WebGPU's largest subgroup): OUT[0] = the active invocations of invocation 0's subgroup,
// OUT[1] = its `subgroup_size` built-in. Binding 0 is the lowering's uniform slot (unused here).

@group(0) @binding(1) var<storage, read_write> OUT: array<u32>;

@compute @workgroup_size(128)
fn subgroup_size(@builtin(local_invocation_index) li: u32, @builtin(subgroup_size) size: u32) {
    let n = subgroupAdd(1u);
    if (li == 0u) {
        OUT[0] = n;
        OUT[1] = size;
    }
}
