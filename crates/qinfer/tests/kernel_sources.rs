//! Source rules of the CUDA kernels that no GPU run would reliably catch,
//! checked on any machine.
//!
//! Every kernel is launched with programmatic stream serialization, so it can
//! be scheduled while the kernel before it is still writing. A kernel that
//! touched an activation before `grid_dependency_wait()` would read stale
//! data only when the timing happened to overlap: a race, not a failure a
//! test run shows. So each kernel's body must begin with that call. The
//! exceptions (`EARLY`) read weights first (the decode attention: the KV
//! rows of earlier passes), and must wait before anything that reads or
//! writes activations (or this pass's rows).

/// Device functions that kernels call first and that read weights (or
/// earlier passes' KV rows) before waiting: (kernel body start, definition, what must come after the wait).
const EARLY: [(&str, &str, &[&str]); 4] = [
    ("gemv_affine_mma<", "__device__ void gemv_affine_mma(", &["amma_stage_x<BITS, HALVES>(", "y[", "bias[o]"]),
    ("rms_norm_group(", "__device__ void rms_norm_group(", &["x4[i]", "y4[i]", "out4[i]", "x[base", "out[base"]),
    (
        "qkv_prologue_head<",
        "__device__ void qkv_prologue_head(",
        &["step[0]", "src[", "kv_store(values", "head[c]", "gate_out[", "kv_store(dst"],
    ),
    (
        "attention_decode<HD, ",
        "__device__ void attention_decode(",
        &[
            "earlier < n",
            "q[",
            "q + ",
            "kv_store(keys",
            "kv_store(values",
            "kv_store(row",
            "kv_store(vs",
            "gate_out[",
            "part_o[",
            "part_ml[",
            "direct[",
        ],
    ),
];

/// Every .cu and .cuh file of the CUDA backend, by name (read from the
/// directory, so a new file cannot escape the check).
fn sources() -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
    let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu" || x == "cuh"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap()))
        .collect();
    out.sort();
    out
}

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
    let sources = sources();
    assert!(sources.len() >= 5, "found only {} .cu files", sources.len());
    let mut count = 0;
    for (file, src) in &sources {
        for (name, body) in kernel_bodies(src) {
            count += 1;
            let first = body.trim_start();
            if EARLY.iter().any(|(call, ..)| first.starts_with(call)) {
                continue; // checked below
            }
            assert!(first.starts_with(WAIT), "{file}: kernel {name} does not begin with {WAIT}");
        }
    }
    assert!(count >= 40, "found only {count} kernels: the scan is broken");
    let all: String = sources.iter().map(|(_, s)| s.as_str()).collect();
    for (_, definition, after) in EARLY {
        let body = &all[all.find(definition).unwrap_or_else(|| panic!("{definition} is defined"))..];
        let wait = body.find(WAIT).unwrap_or_else(|| panic!("{definition} waits"));
        for use_ in after {
            let at = body.find(use_).unwrap_or_else(|| panic!("{definition} uses {use_}"));
            assert!(wait < at, "{definition}: {use_} comes before the wait");
        }
    }
}

/// The `#define NAME <integer>` lines of the .cu files.
fn cu_integer_defines(sources: &[(String, String)]) -> Vec<(String, String, i64)> {
    let mut out = Vec::new();
    for (file, src) in sources {
        for line in src.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("#define") {
                continue;
            }
            let (Some(name), Some(value)) = (words.next(), words.next()) else { continue };
            if let Ok(v) = value.parse::<i64>() {
                out.push((file.clone(), name.to_string(), v));
            }
        }
    }
    out
}

/// Host constants that mirror a kernel's `#define` (launch geometry, shared
/// memory sizes) must hold the same value, or launches run with the wrong
/// grid or too little shared memory: a fault or a silently wrong result on
/// the GPU only. A Rust `const NAME: usize = <integer>;` in the CUDA
/// backend mirrors a define when the define has its name or its doc comment
/// names the define in backticks (as `(`GDN_CHUNK` in gdn_chunked.cu)`).
#[test]
fn host_constants_match_the_kernels_defines() {
    let defines = cu_integer_defines(&sources());
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let src = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = src.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some(rest) = line.strip_prefix("const ") else { continue };
            let Some((name, value)) = rest.split_once(": usize = ") else { continue };
            let Ok(value) = value.trim_end_matches(';').parse::<i64>() else { continue };
            // The doc comment just above: its backticked names.
            let doc: String = lines[..i].iter().rev().take_while(|l| l.starts_with("///")).copied().collect();
            // A define of the same name, else the names in the doc.
            let names: Vec<&str> = if defines.iter().any(|(_, d, _)| d == name) {
                vec![name]
            } else {
                doc.split('`').skip(1).step_by(2).collect()
            };
            for (file, define, v) in &defines {
                if names.contains(&define.as_str()) {
                    assert_eq!(
                        *v,
                        value,
                        "{}: const {name} = {value}, but {file} defines {define} {v}",
                        path.file_name().unwrap().to_string_lossy()
                    );
                    checked.push(format!("{name} = {define}"));
                }
            }
        }
    }
    assert!(checked.len() >= 8, "only {} host constants matched a define: {checked:?}", checked.len());
}

/// The quoted names in the first `[...]` after `marker` in `src`.
fn quoted_names_after(src: &str, marker: &str) -> Vec<String> {
    let start = src.find(marker).unwrap_or_else(|| panic!("{marker} not found")) + marker.len();
    let list = &src[start..start + src[start..].find("];").expect("the list ends")];
    list.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

/// A kernel launched by a literal name must be in the list the backend loads
/// at start (mod.rs `KERNEL_NAMES`; loading that list fails at once on a
/// name no .cu file defines): otherwise the launch fails only when it first
/// runs, on a GPU ("no such kernel").
#[test]
fn every_kernel_launched_by_name_is_loaded() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
    let module = std::fs::read_to_string(dir.join("mod.rs")).unwrap();
    let listed = quoted_names_after(&module, "const KERNEL_NAMES: &[&str] = &[");
    let mut launched = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let src = std::fs::read_to_string(&path).unwrap();
        for call in src.split("launch!(").skip(1) {
            let call: String = call.chars().take(120).filter(|c| !c.is_whitespace()).collect();
            let Some(name) = call.strip_prefix("self,\"").and_then(|rest| rest.split('"').next()) else {
                continue; // a name built at run time
            };
            launched += 1;
            assert!(listed.iter().any(|l| l == name), "{} launches {name}, not in KERNEL_NAMES", path.display());
        }
    }
    assert!(launched > 20, "found only {launched} launches by name: the pattern no longer matches");
}
