//! Config parsing for the MoE and hybrid architectures: the layer rules of each
//! reference (`mlp_only_layers` / `decoder_sparse_step`, `layer_types` /
//! `full_attention_interval`), both spellings of the keys, nesting, and clear
//! errors for configs qinfer cannot run.

use qinfer::config::{Architecture, LayerKind, ModelConfig};
use serde_json::{Value, json};

fn moe() -> Value {
    json!({"model_type":"qwen3_moe","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
           "num_hidden_layers":6,"intermediate_size":96,"vocab_size":256,"head_dim":16,
           "num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":32})
}

fn hybrid() -> Value {
    json!({"model_type":"qwen3_next","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
           "num_hidden_layers":8,"intermediate_size":96,"vocab_size":256,"head_dim":32,
           "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":16,
           "linear_value_head_dim":24,"num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":32,
           "shared_expert_intermediate_size":48})
}

fn parse(v: &Value) -> ModelConfig {
    ModelConfig::from_hf_json(v, None).unwrap()
}

fn err(v: &Value) -> String {
    ModelConfig::from_hf_json(v, None).unwrap_err().to_string()
}

#[test]
fn moe_layers_follow_mlp_only_layers_and_sparse_step() {
    let c = parse(&moe());
    assert_eq!(c.moe_layers, vec![true; 6]);
    let m = c.moe.as_ref().unwrap();
    assert!(!m.norm_topk_prob, "qwen3_moe defaults to no renormalization");
    assert_eq!(m.shared_expert_intermediate_size, None);

    let mut v = moe();
    v["decoder_sparse_step"] = json!(2);
    v["mlp_only_layers"] = json!([3]);
    v["norm_topk_prob"] = json!(true);
    let c = parse(&v);
    // (i + 1) % 2 == 0 → 1, 3, 5; minus layer 3.
    assert_eq!(c.moe_layers, vec![false, true, false, false, false, true]);
    assert!(c.moe.unwrap().norm_topk_prob);
}

#[test]
fn transformers5_expert_count_key_is_accepted() {
    let mut v = moe();
    let n = v.as_object_mut().unwrap().remove("num_experts").unwrap();
    v["num_local_experts"] = n;
    assert_eq!(parse(&v).moe.unwrap().num_experts, 8);
}

#[test]
fn hybrid_layer_kinds_from_interval_or_layer_types() {
    let c = parse(&hybrid());
    use LayerKind::{Attention as F, LinearAttention as L};
    assert_eq!(c.layer_kinds, vec![L, L, L, F, L, L, L, F]);
    assert_eq!(c.rotary_dim, 8, "partial_rotary_factor defaults to 0.25");
    assert!(c.moe.as_ref().unwrap().norm_topk_prob, "qwen3_next defaults to renormalization");
    assert_eq!(c.moe.as_ref().unwrap().shared_expert_intermediate_size, Some(48));

    let mut v = hybrid();
    v["full_attention_interval"] = json!(2);
    assert_eq!(parse(&v).layer_kinds, vec![L, F, L, F, L, F, L, F]);

    let mut v = hybrid();
    v["num_hidden_layers"] = json!(3);
    v["layer_types"] = json!(["full_attention", "linear_attention", "full_attention"]);
    v["rope_parameters"] = json!({"rope_type":"default","rope_theta":1e7,"partial_rotary_factor":0.5});
    let c = parse(&v);
    assert_eq!(c.layer_kinds, vec![F, L, F]);
    assert_eq!(c.rotary_dim, 16);
    assert_eq!(c.rope.theta, 1e7);
}

#[test]
fn qwen3_5_moe_nested_in_text_config_always_renormalizes_and_has_no_dense_width() {
    let mut text = hybrid();
    text["model_type"] = json!("qwen3_5_moe_text");
    text.as_object_mut().unwrap().remove("intermediate_size");
    text["norm_topk_prob"] = json!(false);
    let v = json!({"model_type":"qwen3_5_moe","text_config":text,"vision_config":{"depth":1}});
    let c = parse(&v);
    assert_eq!(c.arch, Architecture::Qwen35Moe);
    assert_eq!(c.moe_layers, vec![true; 8]);
    assert!(c.moe.unwrap().norm_topk_prob);
}

#[test]
fn unsupported_or_inconsistent_configs_name_the_field() {
    let mut v = hybrid();
    v["linear_num_value_heads"] = json!(3);
    assert!(err(&v).contains("linear_num_value_heads"), "{}", err(&v));

    let mut v = hybrid();
    v.as_object_mut().unwrap().remove("linear_key_head_dim");
    assert!(err(&v).contains("linear_key_head_dim"), "{}", err(&v));

    let mut v = moe();
    v["num_experts_per_tok"] = json!(9);
    assert!(err(&v).contains("num_experts_per_tok"), "{}", err(&v));

    let mut v = hybrid();
    v.as_object_mut().unwrap().remove("shared_expert_intermediate_size");
    assert!(err(&v).contains("shared_expert_intermediate_size"), "{}", err(&v));

    let mut v = moe();
    v["layer_types"] = json!(vec!["linear_attention"; 6]);
    assert!(err(&v).contains("layer_types"), "{}", err(&v));

    let mut v = hybrid();
    v["rope_parameters"] = json!({"rope_type":"default","rope_theta":1e7,"partial_rotary_factor":0.01});
    assert!(err(&v).contains("partial_rotary_factor"), "{}", err(&v));

    let mut v = moe();
    v["mlp_only_layers"] = json!("all");
    assert!(err(&v).contains("mlp_only_layers"), "{}", err(&v));
}
