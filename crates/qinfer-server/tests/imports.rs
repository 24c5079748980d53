//! The house's rule 5 (docs/architecture.md): the server talks to the engine
//! (and the tokenizer, for chat templates) and to nothing below them.

use std::path::Path;

#[test]
fn the_server_imports_only_the_engine_and_the_tokenizer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut checked = 0;
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.iter().any(|f| f.ends_with("openai/chat.rs")), "the walk misses subdirectories");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("qinfer::") {
                let module: String =
                    rest[at + 8..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                assert!(
                    matches!(module.as_str(), "engine" | "tokenizer" | "Error" | "Result"),
                    "{}:{}: `qinfer::{module}`: the server may use only qinfer::engine and qinfer::tokenizer",
                    path.display(),
                    n + 1
                );
                checked += 1;
                rest = &rest[at + 8..];
            }
        }
    }
    assert!(checked > 0, "no qinfer:: paths found under {}", src.display());
}

/// Every `.rs` file under `dir`, subdirectories included.
fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}
