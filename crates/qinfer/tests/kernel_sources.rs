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
        &["step[0]", "step[t]", "step[2 * rows", "src[", "kv_store(values", "head[c]", "gate_out[", "kv_store(out"],
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

/// A Rust `const NAME: usize = <integer>;` in the CUDA backend whose name, or
/// a name its doc comment gives in backticks (as "(`GDN_CHUNK`)"), is a
/// kernel's integer `#define` would be a copy of the kernels' value, free to
/// drift from it (launches with the wrong grid or too little shared memory:
/// a fault or a silently wrong result on the GPU only). Shared values are
/// the host's, handed to the kernels as constants.cuh (constants.rs).
#[test]
fn no_host_constant_copies_a_kernel_define() {
    let defines = cu_integer_defines(&sources());
    assert!(defines.len() >= 10, "found only {} integer defines: the scan is broken", defines.len());
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
    let mut consts = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let src = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = src.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some(rest) = line.trim_start_matches("pub(super) ").strip_prefix("const ") else { continue };
            let Some((name, value)) = rest.split_once(": usize = ") else { continue };
            if value.trim_end_matches(';').parse::<i64>().is_err() {
                continue;
            }
            consts += 1;
            // The doc comment just above: its backticked names.
            let doc: String = lines[..i].iter().rev().take_while(|l| l.starts_with("///")).copied().collect();
            let names: Vec<&str> = std::iter::once(name).chain(doc.split('`').skip(1).step_by(2)).collect();
            for (file, define, _) in &defines {
                assert!(
                    !names.contains(&define.as_str()),
                    "{}: const {name} copies {file}'s #define {define}: share it through constants.rs",
                    path.file_name().unwrap().to_string_lossy()
                );
            }
        }
    }
    assert!(consts >= 20, "found only {consts} integer constants: the scan is broken");
}

/// The constants the host shares with the kernels (constants.cuh) are
/// defined by no .cu file, each is used by one, and every file that uses one
/// includes the header.
#[cfg(feature = "cuda")]
#[test]
fn shared_constants_come_from_the_host_only() {
    let shared = qinfer::backend::cuda::kernel_constants();
    assert!(shared.len() >= 20, "only {} shared constants", shared.len());
    let sources = sources();
    let uses = |src: &str, name: &str| {
        src.match_indices(name).any(|(at, _)| {
            let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            !word(src[..at].chars().next_back()) && !word(src[at + name.len()..].chars().next())
        })
    };
    for (name, _) in &shared {
        let mut used = false;
        for (file, src) in &sources {
            let code: String = src.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
            assert!(!code.contains(&format!("#define {name} ")), "{file} defines {name}, which constants.rs owns");
            if uses(&code, name) {
                used = true;
                assert!(
                    code.contains("#include \"constants.cuh\""),
                    "{file} uses {name} without including constants.cuh"
                );
            }
        }
        assert!(used, "no kernel uses the shared constant {name}");
    }
}

/// Whether a skipped check must fail instead: set on the GPU machine
/// (bench/cuda_h200.sh), where NVRTC and CUDA's headers are present.
#[cfg(feature = "cuda")]
fn require_gpu() -> bool {
    std::env::var("QINFER_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The kernels the backend resolves by name are the kernels the .cu files
/// define, unit by unit: none missing (the backend would fail to start) and
/// none left over (a kernel no op launches). The names of kernels defined
/// outside macros are read from the sources on any machine; every kernel's,
/// from the PTX NVRTC compiles (or the kernel cache holds) where NVRTC and
/// CUDA's headers are at hand.
#[cfg(feature = "cuda")]
#[test]
fn the_backend_resolves_exactly_the_kernels_the_sources_define() {
    use std::collections::{BTreeMap, BTreeSet};
    let resolved = qinfer::backend::cuda::kernel_names();
    let mut by_unit: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for (unit, name) in &resolved {
        assert!(by_unit.entry(unit).or_default().insert(name.clone()), "{name} is resolved twice");
    }
    let sources = sources();
    let mut literal = 0;
    for (unit, names) in &by_unit {
        let (_, src) = sources.iter().find(|(f, _)| f == unit).unwrap_or_else(|| panic!("{unit} is not a .cu file"));
        for (name, _) in kernel_bodies(src) {
            // Kernels of macros are named by token pasting (or a parameter).
            if name.contains('#') || name.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                continue;
            }
            literal += 1;
            assert!(names.contains(&name), "{unit} defines kernel {name}, which the backend does not resolve");
        }
    }
    assert!(literal >= 30, "found only {literal} kernels defined outside macros: the scan is broken");
    let ptx = match qinfer::backend::cuda::unit_ptx("compute_90a") {
        Ok(ptx) => ptx,
        Err(e) if !require_gpu() => return println!("skipping the PTX comparison: {e}"),
        Err(e) => panic!("QINFER_REQUIRE_GPU=1, but the kernels cannot be compiled: {e}"),
    };
    for (unit, text) in ptx {
        let entries: BTreeSet<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix(".visible .entry "))
            .map(|l| l.split('(').next().unwrap_or("").to_string())
            .collect();
        let names = by_unit.remove(unit).unwrap_or_default();
        let unresolved: Vec<_> = entries.difference(&names).collect();
        let undefined: Vec<_> = names.difference(&entries).collect();
        assert!(unresolved.is_empty(), "{unit} defines kernels the backend does not resolve: {unresolved:?}");
        assert!(undefined.is_empty(), "the backend resolves kernels {unit} does not define: {undefined:?}");
        println!("{unit}: {} kernels", entries.len());
    }
    assert!(by_unit.is_empty(), "kernels resolved from units that are not compiled: {by_unit:?}");
}

/// `src` without its `record(...)` calls, whose op names (`"attention"`)
/// may be spelled as a kernel is.
#[cfg(feature = "cuda")]
fn without_recorded_errors(src: &str) -> String {
    let mut out = String::new();
    let mut rest = src;
    while let Some(at) = rest.find("record(") {
        out.push_str(&rest[..at]);
        let mut depth = 0;
        let end = rest[at..]
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                c == ')' && depth == 0
            })
            .map_or(rest.len(), |(i, _)| at + i + 1);
        rest = &rest[end..];
    }
    out + rest
}

/// Kernels are launched through their family's table of resolved functions
/// with typed arguments, never looked up by a name at launch: a kernel's
/// name is spelled (as a string) only in its family's `load`, and no
/// launch takes an untyped argument list.
#[cfg(feature = "cuda")]
#[test]
fn kernels_are_named_only_where_their_family_resolves_them() {
    let names = qinfer::backend::cuda::kernel_names();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
    let mut loads = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let src = without_recorded_errors(&std::fs::read_to_string(&path).unwrap());
        assert!(!src.contains("launch_args(") && !src.contains("launch!("), "{file} launches with untyped arguments");
        // The bodies of the `load` functions.
        let mut bodies = Vec::new();
        for (at, _) in src.match_indices("fn load(") {
            let open = at + src[at..].find('{').expect("a body");
            let mut depth = 0;
            let close = open
                + src[open..]
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += match c {
                            '{' => 1,
                            '}' => -1,
                            _ => 0,
                        };
                        depth == 0
                    })
                    .expect("a closed body")
                    .0;
            bodies.push(open..close);
            loads += 1;
        }
        for (_, name) in &names {
            for (at, _) in src.match_indices(&format!("\"{name}\"")) {
                assert!(bodies.iter().any(|b| b.contains(&at)), "{file} names kernel {name} outside a `load`");
            }
        }
    }
    assert!(loads >= 8, "found only {loads} `load` functions: the scan is broken");
}
