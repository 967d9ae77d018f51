//! moe.cu: the MoE block and its routing.

use crate::common::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_block_and_routing_match_cpu() {
    let rig = BlockRig::new(8);
    let c = rig.cfg.clone();
    let mut rng = Rng(7);
    let (h, e) = (c.hidden, c.n_experts);
    let w = random_moe(&mut rng, &c);
    let dw = upload_moe(&rig.g, "moe", &w).unwrap();
    for (grouped, n) in [(false, 1usize), (false, 6), (true, 6), (true, 8)] {
        rig.moe_grouped.set(grouped);
        let x = rng.vec(n * h, 0.5);
        let xn = rng.vec(n * h, 1.0);
        let got = rig.run(&x, &xn, |f| f.moe(&dw, n).unwrap());
        check(
            &format!("moe block T={n} grouped={grouped}"),
            &got,
            &ops::moe(&c, &w, &xn),
            1e-4,
        );
        // The routing the block used, against the CPU router on the same logits.
        let logits: Vec<f32> = rig.g.read(&rig.scratch.router, 0, n * e).unwrap();
        check("router logits", &logits, &matmul(&w.router, &xn), 1e-5);
        let ids: Vec<i32> = rig.g.read(&rig.scratch.ids, 0, n * c.top_k).unwrap();
        let rw: Vec<f32> = rig.g.read(&rig.scratch.route_w, 0, n * c.top_k).unwrap();
        for t in 0..n {
            let want = ops::route(&logits[t * e..(t + 1) * e], c.top_k);
            for (k, (we, wp)) in want.iter().enumerate() {
                assert_eq!(
                    ids[t * c.top_k + k] as usize,
                    *we,
                    "token {t} slot {k}: expert"
                );
                assert!(
                    (rw[t * c.top_k + k] - wp).abs() < 1e-6,
                    "token {t} slot {k}: weight"
                );
            }
        }
        println!("KERNEL moe_route T={n}: ids and weights equal the CPU router's");
    }
}
