//! deltanet.cu: the Gated DeltaNet block and its recurrent and conv state.

use crate::common::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn deltanet_block_and_state_match_cpu_over_chunks() {
    let rig = BlockRig::new(8);
    let c = rig.cfg.clone();
    let mut rng = Rng(6);
    let h = c.hidden;
    let w = random_deltanet(&mut rng, &c);
    let dw = upload_deltanet(&rig.g, &c, "dn", &w).unwrap();
    let mut st = ops::DeltaNetState::new(&c);
    for n in [5usize, 1, 8, 2] {
        let x = rng.vec(n * h, 0.5);
        let xn = rng.vec(n * h, 1.0);
        let (state, conv) = &rig.seq.dn[0];
        let got = rig.run(&x, &xn, |f| {
            f.deltanet(&dw, state.ptr, conv.ptr, n).unwrap()
        });
        let want = ops::deltanet(&c, &w, &xn, &mut st);
        check(&format!("deltanet block T={n}"), &got, &want, 1e-4);
        let s: Vec<f32> = rig.g.read(state, 0, st.state.len()).unwrap();
        check(
            &format!("deltanet recurrent state after T={n}"),
            &s,
            &st.state,
            1e-4,
        );
        let cv: Vec<f32> = rig.g.read(conv, 0, st.conv.len()).unwrap();
        check(
            &format!("deltanet conv state after T={n}"),
            &cv,
            &st.conv,
            1e-6,
        );
    }
}
