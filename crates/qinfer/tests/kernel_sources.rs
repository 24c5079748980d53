//! Source rules of the CUDA kernels that no GPU run would reliably catch,
//! checked on any machine.
//!
//! Every kernel is launched with programmatic stream serialization, so it can
//! be scheduled while the kernel before it is still writing. A kernel that
//! touched an activation before `grid_dependency_wait()` would read stale
//! data only when the timing happened to overlap: a race, not a failure a
//! test run shows. So each kernel's body must begin with that call. The one
//! exception reads weights first (the affine tensor-core GEMV), and it must
//! wait before it stages x.

const SOURCES: [(&str, &str); 5] = [
    ("kernels.cu", include_str!("../src/backend/cuda/kernels.cu")),
    ("flash.cu", include_str!("../src/backend/cuda/flash.cu")),
    ("gdn.cu", include_str!("../src/backend/cuda/gdn.cu")),
    ("affine_mma.cu", include_str!("../src/backend/cuda/affine_mma.cu")),
    ("sampling.cu", include_str!("../src/backend/cuda/sampling.cu")),
];

const WAIT: &str = "grid_dependency_wait();";

/// The body of each `__global__` function, from just after its opening brace
/// (macro line continuations removed).
fn kernel_bodies(src: &str) -> Vec<(String, String)> {
    let src = src.replace("\\\n", "\n");
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = src[at..].find("__global__") {
        let start = at + i;
        let open = start + src[start..].find('{').expect("a kernel has a body");
        let head = &src[start..open];
        let name = head
            .split('(')
            .filter_map(|part| part.split_whitespace().last())
            .find(|w| !w.starts_with("__launch_bounds__") && *w != "__global__")
            .unwrap_or("?")
            .to_string();
        out.push((name, src[open + 1..].to_string()));
        at = open + 1;
    }
    out
}

#[test]
fn every_kernel_waits_for_the_previous_one_before_touching_activations() {
    let mut count = 0;
    for (file, src) in SOURCES {
        for (name, body) in kernel_bodies(src) {
            count += 1;
            let first = body.trim_start();
            if first.starts_with("gemv_affine_mma<") {
                continue; // checked below
            }
            assert!(first.starts_with(WAIT), "{file}: kernel {name} does not begin with {WAIT}");
        }
    }
    assert!(count >= 40, "found only {count} kernels: the scan is broken");
    // The affine GEMV issues its first weight copies, then waits, then stages x.
    let (_, src) = SOURCES[3];
    let body = &src[src.find("__device__ void gemv_affine_mma(").expect("the affine GEMV is defined")..];
    let wait = body.find(WAIT).expect("the affine GEMV waits");
    let stage_x = body.find("amma_stage_x<BITS>(").expect("the affine GEMV stages x");
    assert!(wait < stage_x, "the affine GEMV must wait before it reads x");
    assert!(!body[..wait].contains("y["), "the affine GEMV must not write before it waits");
}
