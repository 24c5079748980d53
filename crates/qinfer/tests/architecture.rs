//! The house's rules (docs/architecture.md), checked on the source: which
//! top-level module may import which, and no import loop between files.
//!
//! Every `crate::`, `super::` and `self::` path in a source file (outside its
//! `#[cfg(test)]` modules, comments and string literals) is resolved to the
//! deepest source file that defines a prefix of it. A failure names the file,
//! the path and the rule.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What each top-level module of `qinfer` may import, besides itself and the
/// crate root's `Error`/`Result`. Lower layers first; arrows point down only.
const ALLOWED: &[(&str, &[&str], &str)] = &[
    ("error", &[], "the error type"),
    // Stored tensors and their storage types: one layer (a tensor decodes its
    // blocks through quant/, and quantized tensors are made of tensors).
    ("tensor", &["quant"], "stored tensors"),
    ("quant", &["tensor"], "quantized storage formats"),
    ("npy", &["tensor"], "the .npy writer"),
    ("config", &[], "model configuration and RoPE tables"),
    ("sampling", &[], "sampling parameters and the reference sampler"),
    ("image", &[], "images decoded and prepared as the vision processor does"),
    // Rule 4: formats hand out tensors and metadata; never a tokenizer or a kernel.
    ("formats", &["tensor", "quant", "config"], "file formats"),
    ("tokenizer", &["formats"], "tokenizers and chat templates"),
    ("lora", &["tensor", "formats"], "LoRA adapters read from their files"),
    // Rule 2: host bookkeeping only, never the backend.
    ("kv", &["tensor", "quant", "config"], "KV cache formats (their codecs in quant) and bookkeeping"),
    // Rule 1: the backend imports nothing above itself.
    ("backend", &["tensor", "quant", "config", "sampling", "kv"], "compute backends"),
    ("weights", &["tensor", "quant", "config", "formats", "backend"], "weights by name and shape"),
    // Rule 3: layers see a batch description, never a sequence, the
    // scheduler or a sampler.
    ("layers", &["tensor", "quant", "config", "kv", "backend", "weights", "lora"], "model building blocks"),
    // Models may name `sampling` only for the device-side pick of the
    // one-sequence decode loop, which moves to the runner with the batched
    // engine; they never see the engine.
    (
        "models",
        &["tensor", "quant", "config", "formats", "kv", "backend", "weights", "layers", "sampling", "lora", "image"],
        "one file per architecture",
    ),
    ("quantize", &["tensor", "quant", "config", "formats"], "the HF → MLX quantizer"),
    (
        "loader",
        &[
            "tensor",
            "quant",
            "config",
            "sampling",
            "formats",
            "tokenizer",
            "kv",
            "backend",
            "weights",
            "models",
            "lora",
            "image",
        ],
        "opening a model and placing it on a device",
    ),
    // Sequences become the batch description here and nowhere else.
    (
        "runner",
        &["tensor", "config", "sampling", "kv", "models", "image"],
        "one forward over a batch, and its sampling",
    ),
    (
        "engine",
        &["tensor", "config", "sampling", "tokenizer", "kv", "models", "loader", "runner", "lora", "image"],
        "requests and their lifecycle",
    ),
];

fn src_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The module path a file defines (`backend/cpu/mod.rs` → `backend::cpu`).
fn module_of(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src_root()).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The source with comments, string and char literals blanked out, so that
/// what remains is code.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &src[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |e| e + 2);
        } else if let Some(hashes) = raw_string_start(rest) {
            let close = format!("\"{}", "#".repeat(hashes));
            let body = &rest[hashes + 2..];
            i += hashes + 2 + body.find(&close).map_or(body.len(), |e| e + close.len());
            out.push_str("\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if let Some(len) = char_literal(rest) {
            i += len;
            out.push_str("' '");
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn raw_string_start(s: &str) -> Option<usize> {
    let t = s.strip_prefix('r')?;
    let hashes = t.len() - t.trim_start_matches('#').len();
    t[hashes..].starts_with('"').then_some(hashes)
}

fn char_literal(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    if b.first() != Some(&b'\'') {
        return None;
    }
    if b.get(1) == Some(&b'\\') {
        return s[2..].find('\'').map(|e| e + 3);
    }
    let c = s[1..].chars().next()?;
    (s[1 + c.len_utf8()..].starts_with('\'')).then_some(2 + c.len_utf8())
}

/// The code with every `#[cfg(test)]` item (unit-test modules) removed.
fn without_test_modules(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // The item ends at its `;` or at the brace that closes its first `{`.
        let (semi, brace) = (after.find(';'), after.find('{'));
        let end = match (semi, brace) {
            (Some(s), Some(b)) if s < b => s + 1,
            (_, Some(b)) => {
                let mut depth = 0;
                let mut end = after.len();
                for (k, c) in after[b..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = b + k + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (Some(s), None) => s + 1,
            (None, None) => after.len(),
        };
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Every path that starts with `crate::`, `super::` or `self::`, expanded
/// through `{…}` groups, as module segments relative to the crate root.
fn crate_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for anchor in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(pos) = code[from..].find(anchor) {
            let at = from + pos;
            from = at + anchor.len();
            if code[..at].chars().next_back().is_some_and(|c| is_ident(c) || c == ':') {
                continue;
            }
            let mut base: Vec<String> = match anchor {
                "crate::" => Vec::new(),
                "super::" => module[..module.len().saturating_sub(1)].to_vec(),
                _ => module.to_vec(),
            };
            let mut tail = &code[from..];
            // Further `super::` hops.
            while let Some(t) = tail.strip_prefix("super::") {
                base.pop();
                tail = t;
            }
            expand(tail, base, &mut out);
        }
    }
    out
}

/// Segments of `tail` (the text after a path's anchor) appended to `base`;
/// a `{a, b::c}` group yields one path per member.
fn expand(tail: &str, mut base: Vec<String>, out: &mut Vec<Vec<String>>) {
    let mut t = tail;
    loop {
        let ident: String = t.chars().take_while(|&c| is_ident(c)).collect();
        if !ident.is_empty() {
            t = &t[ident.len()..];
            if ident != "self" {
                base.push(ident);
            }
            match t.strip_prefix("::") {
                Some(r) => t = r,
                None => break,
            }
        } else if let Some(group) = t.strip_prefix('{') {
            let mut depth = 1;
            let mut start = 0;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' | ',' if depth == 1 => {
                        expand(group[start..k].trim_start(), base.clone(), out);
                        start = k + 1;
                        if c == '}' {
                            return;
                        }
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            return;
        } else {
            break;
        }
    }
    out.push(base);
}

/// Paths of `use child::…` (a 2018-edition relative path into a child module
/// of this file's module, such as a `mod.rs` re-exporting from its files).
fn child_paths(code: &str, module: &[String], files: &BTreeMap<Vec<String>, PathBuf>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(pos) = code[from..].find("use ") {
        let at = from + pos;
        from = at + 4;
        if code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let tail = code[from..].trim_start();
        let first: String = tail.chars().take_while(|&c| is_ident(c)).collect();
        let mut child = module.to_vec();
        child.push(first.clone());
        if !first.is_empty() && tail[first.len()..].starts_with("::") && files.contains_key(&child) {
            expand(&tail[first.len() + 2..], child, &mut out);
        }
    }
    out
}

struct Crate {
    /// Module path → file.
    files: BTreeMap<Vec<String>, PathBuf>,
    /// File's module → (the module each import resolves to, the import as written).
    imports: BTreeMap<Vec<String>, Vec<(Vec<String>, String)>>,
}

fn read_crate() -> Crate {
    let mut paths = Vec::new();
    rust_files(&src_root(), &mut paths);
    let files: BTreeMap<Vec<String>, PathBuf> = paths.iter().map(|p| (module_of(p), p.clone())).collect();
    let mut imports = BTreeMap::new();
    for (module, file) in &files {
        let code = without_test_modules(&code_only(&std::fs::read_to_string(file).unwrap()));
        let mut found = Vec::new();
        let mut paths = crate_paths(&code, module);
        paths.extend(child_paths(&code, module, &files));
        for path in paths {
            let target = (0..=path.len()).rev().map(|k| path[..k].to_vec()).find(|p| files.contains_key(p));
            if let Some(target) = target
                && &target != module
            {
                found.push((target, format!("crate::{}", path.join("::"))));
            }
        }
        imports.insert(module.clone(), found);
    }
    Crate { files, imports }
}

fn rel(file: &Path) -> String {
    file.strip_prefix(src_root().parent().unwrap()).unwrap().display().to_string()
}

#[test]
fn imports_point_down_the_layers() {
    let krate = read_crate();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().map(|(m, a, _)| (*m, *a)).collect();
    let mut broken = Vec::new();
    for (module, found) in &krate.imports {
        let Some(top) = module.first() else { continue };
        let Some(may) = allowed.get(top.as_str()) else {
            broken.push(format!("{}: top-level module `{top}` has no entry in ALLOWED", rel(&krate.files[module])));
            continue;
        };
        for (target, written) in found {
            let Some(to) = target.first() else { continue };
            if to != top && !may.contains(&to.as_str()) {
                broken.push(format!(
                    "{}: `{written}` imports `{to}`, which `{top}` may not import (it may import {may:?})",
                    rel(&krate.files[module])
                ));
            }
        }
    }
    assert!(broken.is_empty(), "imports against the layering rules:\n{}", broken.join("\n"));
}

#[test]
fn every_top_level_module_has_a_rule() {
    let krate = read_crate();
    let tops: BTreeSet<&str> = krate.files.keys().filter_map(|m| m.first()).map(String::as_str).collect();
    let ruled: BTreeSet<&str> = ALLOWED.iter().map(|(m, _, _)| *m).collect();
    assert_eq!(tops, ruled, "src/ top-level modules and the ALLOWED table differ");
}

/// Folders whose files are one type's methods split by op family, and so
/// reference each other: each is checked as one node (its imports from
/// outside must still point down and form no loop), with the reason.
const ONE_TYPE_FOLDERS: &[(&[&str], &str)] = &[(
    &["backend", "cuda"],
    "CudaBackend's launchers are its methods, one file per op family, and its kernel table holds every family's kernels",
)];

/// `module`, or the one-type folder it belongs to.
fn node_of(module: &[String]) -> Vec<String> {
    for (folder, _) in ONE_TYPE_FOLDERS {
        if module.len() >= folder.len() && module.iter().zip(folder.iter()).all(|(a, b)| a == b) {
            return folder.iter().map(|s| s.to_string()).collect();
        }
    }
    module.to_vec()
}

#[test]
fn no_import_loop_between_files() {
    let krate = read_crate();
    let mut nodes: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut files = krate.files.clone();
    for (m, found) in &krate.imports {
        let from = node_of(m);
        files.entry(from.clone()).or_insert_with(|| krate.files[m].clone());
        let to = nodes.entry(from.clone()).or_default();
        to.extend(found.iter().map(|(t, _)| node_of(t)).filter(|t| *t != from));
    }
    let krate = Crate { files, imports: BTreeMap::new() };
    let graph: BTreeMap<&Vec<String>, BTreeSet<&Vec<String>>> =
        nodes.iter().map(|(m, to)| (m, to.iter().collect())).collect();
    // Depth-first search for a back edge; the cycle is the stack from its target.
    fn visit<'a>(
        node: &'a Vec<String>,
        graph: &BTreeMap<&'a Vec<String>, BTreeSet<&'a Vec<String>>>,
        state: &mut BTreeMap<&'a Vec<String>, u8>,
        stack: &mut Vec<&'a Vec<String>>,
    ) -> Option<Vec<&'a Vec<String>>> {
        state.insert(node, 1);
        stack.push(node);
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|n| n == next).unwrap();
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(next);
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(next, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(node, 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if !state.contains_key(node)
            && let Some(cycle) = visit(node, &graph, &mut state, &mut Vec::new())
        {
            let names: Vec<String> = cycle.iter().map(|m| rel(&krate.files[*m])).collect();
            panic!("import loop between files: {}", names.join(" → "));
        }
    }
}

/// The checker itself: paths through groups and `super::` resolve as rustc
/// resolves them, and what hides in comments or strings is not an import.
#[test]
fn the_path_reader_sees_what_rustc_sees() {
    let module = vec!["backend".to_string(), "cpu".to_string()];
    let code = code_only(
        "use crate::{kv::KvCache, quant::{affine, ggml::f16_at}};\n\
         use super::super::config::Rope; // crate::engine::x\n\
         let s = \"crate::loader::open\"; let c = '{';\n\
         #[cfg(test)]\nmod tests { use crate::formats::gguf; }\n\
         fn f() { self::inner::g(); }",
    );
    let got: Vec<String> = crate_paths(&without_test_modules(&code), &module).iter().map(|p| p.join("::")).collect();
    assert_eq!(got, ["kv::KvCache", "quant::affine", "quant::ggml::f16_at", "config::Rope", "backend::cpu::inner::g"]);
    let files: BTreeMap<Vec<String>, PathBuf> =
        [(vec!["backend".to_string(), "ops".to_string()], PathBuf::new())].into_iter().collect();
    let code = "pub use ops::{FusedOps, GdnOps};\nuse std::sync::Arc;";
    let got: Vec<String> = child_paths(code, &module[..1], &files).iter().map(|p| p.join("::")).collect();
    assert_eq!(got, ["backend::ops::FusedOps", "backend::ops::GdnOps"]);
}

/// Small files, one concept each: no source file of any crate (Rust or
/// CUDA) over 800 lines, generated files (marked `@generated` in their first
/// lines) excepted.
#[test]
fn no_source_file_over_800_lines() {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "rs" || e == "cu" || e == "cuh") {
                out.push(p);
            }
        }
    }
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = Vec::new();
    for krate in std::fs::read_dir(crates).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.is_dir() {
            walk(&src, &mut files);
        }
    }
    assert!(files.len() > 50, "found only {} source files under {}", files.len(), crates.display());
    let mut long = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let generated = text.lines().take(5).any(|l| l.contains("@generated"));
        let lines = text.lines().count();
        if lines > 800 && !generated {
            long.push(format!("{}: {lines} lines", f.strip_prefix(crates).unwrap().display()));
        }
    }
    assert!(long.is_empty(), "source files over 800 lines:\n{}", long.join("\n"));
}
