//! The three ways checkpoints store experts give the same model: the qwen3_moe
//! fixture (one tensor per expert, as Qwen3-30B-A3B is published) rewritten
//! with fused `experts.gate_up_proj` / `experts.down_proj` (Qwen3.5-MoE) and
//! with stacked `switch_mlp.*` (MLX) must produce bit-identical logits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use qinfer::loader;
use qinfer::models::Logits;
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3_moe")
}

type Tensors = BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

fn read_tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect()
}

fn write_model(tag: &str, tensors: &Tensors) -> PathBuf {
    let d = std::env::temp_dir().join(format!("qinfer-moe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(fixture().join(f), d.join(f)).unwrap();
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (dt, shape, data))| (n.clone(), TensorView::new(*dt, shape.clone(), data).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &d.join("model.safetensors")).unwrap();
    d
}

/// Replaces `experts.N.{gate,up,down}_proj.weight` of every MoE layer with
/// stacked tensors made by `stack(layer_prefix, gates, ups, downs)`.
fn restack(
    src: &Tensors,
    num_experts: usize,
    stack: impl Fn(&str, &[&[u8]], &[&[u8]], &[&[u8]], &mut Tensors),
) -> Tensors {
    let mut out: Tensors =
        src.iter().filter(|(n, _)| !n.contains(".experts.")).map(|(n, t)| (n.clone(), t.clone())).collect();
    let layers: Vec<String> =
        src.keys().filter_map(|n| n.strip_suffix(".experts.0.gate_proj.weight").map(str::to_string)).collect();
    assert!(!layers.is_empty());
    for p in layers {
        let get = |e: usize, proj: &str| src[&format!("{p}.experts.{e}.{proj}.weight")].2.as_slice();
        let g: Vec<&[u8]> = (0..num_experts).map(|e| get(e, "gate_proj")).collect();
        let u: Vec<&[u8]> = (0..num_experts).map(|e| get(e, "up_proj")).collect();
        let d: Vec<&[u8]> = (0..num_experts).map(|e| get(e, "down_proj")).collect();
        stack(&p, &g, &u, &d, &mut out);
    }
    out
}

fn logits(dir: &Path, ids: &[u32]) -> Vec<f32> {
    let lm = loader::open(dir).unwrap().load_cpu(false).unwrap();
    let mut seq = lm.new_sequence(ids.len());
    lm.forward(seq.as_mut(), ids, Logits::All).unwrap()
}

#[test]
fn per_expert_fused_and_switch_mlp_layouts_agree() {
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap();
    let ids: Vec<u32> = reference["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let e = cfg["num_experts"].as_u64().unwrap() as usize;
    let (h, i) =
        (cfg["hidden_size"].as_u64().unwrap() as usize, cfg["moe_intermediate_size"].as_u64().unwrap() as usize);
    let src = read_tensors(&fixture().join("model.safetensors"));
    let dt = src["model.embed_tokens.weight"].0;
    let want = logits(&fixture(), &ids);

    let fused = restack(&src, e, |p, g, u, d, out| {
        let gate_up: Vec<u8> = (0..e).flat_map(|x| [g[x], u[x]].concat()).collect();
        out.insert(format!("{p}.experts.gate_up_proj"), (dt, vec![e, 2 * i, h], gate_up));
        out.insert(format!("{p}.experts.down_proj"), (dt, vec![e, h, i], d.concat()));
    });
    assert_eq!(logits(&write_model("fused", &fused), &ids), want, "fused experts");

    let switch = restack(&src, e, |p, g, u, d, out| {
        out.insert(format!("{p}.switch_mlp.gate_proj.weight"), (dt, vec![e, i, h], g.concat()));
        out.insert(format!("{p}.switch_mlp.up_proj.weight"), (dt, vec![e, i, h], u.concat()));
        out.insert(format!("{p}.switch_mlp.down_proj.weight"), (dt, vec![e, h, i], d.concat()));
    });
    assert_eq!(logits(&write_model("switch", &switch), &ids), want, "switch_mlp experts");

    // A fused checkpoint missing its down projection names the tensor.
    let mut broken = fused.clone();
    let down = broken.keys().find(|n| n.ends_with("experts.down_proj")).unwrap().clone();
    broken.remove(&down);
    let dir = write_model("broken", &broken);
    let e = loader::open(&dir).unwrap().load_cpu(false).err().expect("missing down_proj is an error").to_string();
    assert!(e.contains("down_proj"), "{e}");
}
