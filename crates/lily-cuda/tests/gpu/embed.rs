//! embed.cu: the embedding lookup.

use crate::common::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn embed_matches_dequantised_rows() {
    let g = gpu();
    let mut rng = Rng(3);
    for bits in [4u32, 8, 16] {
        let (vocab, hidden) = (50, 128);
        let w = linear(&mut rng, bits, 1, vocab, hidden);
        let dw = upload_linear(&g, "embed", &w).unwrap();
        let tokens: Vec<i32> = vec![3, 49, 0, 7, 3];
        let dt = g.upload(&tokens).unwrap();
        let dx = poisoned(&g, tokens.len() * hidden);
        let lookup = Lookup {
            table: &dw,
            tokens: dt.ptr,
            x: dx.ptr,
            n_tok: tokens.len(),
        };
        g.k.embed.lookup(&g, &lookup).unwrap();
        let x: Vec<f32> = g.read(&dx, 0, tokens.len() * hidden).unwrap();
        let mut want = vec![0f32; tokens.len() * hidden];
        for (row, &t) in want.chunks_mut(hidden).zip(&tokens) {
            w.dequant_row(t as usize, row);
        }
        check(&format!("embed bits={bits}"), &x, &want, 1e-6);
    }
}
