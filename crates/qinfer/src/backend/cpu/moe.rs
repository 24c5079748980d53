//! Mixture-of-experts routing and the grouped expert pass on the CPU. Routing
//! follows transformers' `TopKRouter` (softmax in f32 over all experts, top-k,
//! optional renormalization); experts run once per batch over the tokens routed
//! to them (as `Qwen3MoeExperts.forward`), so each expert's weights are read once.

use crate::backend::Routing;

/// The chosen `(expert, weight)` pairs of every token, best first.
pub fn route(logits: &[f32], num_experts: usize, routing: Routing) -> Vec<Vec<(usize, f32)>> {
    logits
        .chunks_exact(num_experts)
        .map(|row| {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let exps: Vec<f32> = row.iter().map(|&v| (v - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let mut probs: Vec<(usize, f32)> = exps.iter().map(|&e| e / sum).enumerate().collect();
            // Stable: equal probabilities keep the lower expert index first.
            probs.sort_by(|a, b| b.1.total_cmp(&a.1));
            probs.truncate(routing.top_k);
            if routing.renormalize {
                let s: f32 = probs.iter().map(|p| p.1).sum();
                probs.iter_mut().for_each(|p| p.1 /= s);
            }
            probs
        })
        .collect()
}

/// Tokens routed to each expert, with their weights, in token order.
pub fn group_by_expert(routes: &[Vec<(usize, f32)>], num_experts: usize) -> Vec<Vec<(usize, f32)>> {
    let mut groups = vec![Vec::new(); num_experts];
    for (t, r) in routes.iter().enumerate() {
        for &(e, w) in r {
            groups[e].push((t, w));
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_of_softmax_with_and_without_renormalization() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let raw = route(&logits, 4, Routing { top_k: 2, renormalize: false });
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert_eq!(raw[0][0].0, 1);
        assert_eq!(raw[0][1].0, 2);
        assert!((raw[0][0].1 - 3f32.exp() / z).abs() < 1e-6);
        let norm = route(&logits, 4, Routing { top_k: 2, renormalize: true });
        assert!((norm[0][0].1 + norm[0][1].1 - 1.0).abs() < 1e-6);
        assert!((norm[0][0].1 - 3f32.exp() / (3f32.exp() + 2f32.exp())).abs() < 1e-6);
    }

    #[test]
    fn grouping_lists_each_token_under_its_experts() {
        let routes = vec![vec![(2, 0.7), (0, 0.3)], vec![(2, 0.6), (1, 0.4)]];
        let g = group_by_expert(&routes, 3);
        assert_eq!(g[0], vec![(0, 0.3)]);
        assert_eq!(g[1], vec![(1, 0.4)]);
        assert_eq!(g[2], vec![(0, 0.7), (1, 0.6)]);
    }
}
