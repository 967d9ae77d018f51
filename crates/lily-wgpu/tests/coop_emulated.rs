//! linear_q4_mm_coop.wgsl (prefill's 4-bit products on cooperative matrices) on an adapter
//! without cooperative matrices: its operations emulated in plain WGSL. A test binary of its own
//! so that lavapipe runs it alone (beside model.rs's tests it ran ≈ 50× slower). Without any
//! adapter it is skipped with a message, except under CI=true.

use lily_core::backend::Backend;
use lily_core::cpu::CpuBackend;
use lily_core::synth::{Preset, SynthFormat};
use lily_wgpu::WgpuOptions;

mod support;
use support::{rel_l2, synth_model, wgpu_backend_with, Rng};

/// linear_q4_mm_coop.wgsl's own logic (tiles, dequantisation, the input's two parts, bias
/// terms, expert tiles, accumulation, output) on any adapter: its cooperative-matrix operations
/// emulated in plain WGSL (`WgpuOptions::emulate_coop`), teacher-forced logits against the CPU
/// over 40 positions in one chunk (plain tiles and routed-expert tiles of up to 16 items).
#[test]
fn cooperative_kernel_logic_matches_cpu_emulated() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 23);
    let positions = 40;
    let tokens = Rng(3).tokens(positions, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(16);
    let cs = cpu.new_seq(positions + 4).unwrap();
    let want = cpu.prefill_all_logits(cs, &tokens).unwrap();
    let Some(mut gpu) = wgpu_backend_with(
        &w,
        WgpuOptions {
            chunk: 40,
            all_logits_chunk: 40,
            emulate_coop: true,
            ..WgpuOptions::default()
        },
    ) else {
        return;
    };
    let (on, note) = gpu.coop();
    println!("{note}");
    assert!(on, "the cooperative kernel is in use");
    let (_, _, coop) = gpu.check_products().unwrap();
    let coop = coop.expect("in use");
    println!("linear_q4_mm_coop (emulated) vs the host's product: {coop:.2e}");
    assert!(
        coop < 1e-5,
        "emulated linear_q4_mm_coop differs from the host by {coop:.2e}"
    );
    // The probe the H200 runs where the real kernel is refused ($LILY_WGPU_COOP_DIAG=1): on a
    // right kernel every case is right and every block of its map is `.`.
    let lines = gpu.probe_products().unwrap();
    assert_eq!(lines.len(), 7);
    for l in &lines {
        println!("{l}");
        if let Some((_, map)) = l.split_once("map (16 rows a character, 8 items a group): ") {
            assert!(map.chars().all(|c| c == '.' || c == '|'), "{l}");
        }
    }
    assert!(
        lines[0].ends_with(": ..........|..........|..........|..........|.........."),
        "{}",
        lines[0]
    );
    // …and it names known faults: the bias terms left out (every block `p` where the biases
    // are not 0), and the second tile's cooperative products left out (its items `b`).
    let v = "let v = cs[n * 64u + lid] + bs[n * 64u + lid];";
    let faulty = gpu
        .probe_emulated_with(|s| {
            assert!(s.contains(v));
            s.replace(v, "let v = cs[n * 64u + lid];")
        })
        .unwrap();
    println!("bias terms left out: {}", faulty[0]);
    assert!(faulty[0].ends_with(": pppppppppp|pppppppppp|pppppppppp|pppppppppp|pppppppppp"));
    assert!(
        faulty[3].ends_with(": ....|....|....|...."),
        "{}",
        faulty[3]
    );
    let faulty = gpu
        .probe_emulated_with(|s| {
            s.replace(
                v,
                "let v = select(cs[n * 64u + lid], 0.0, wid.z == 1u) + bs[n * 64u + lid];",
            )
        })
        .unwrap();
    println!("second tile's products left out: {}", faulty[0]);
    assert!(faulty[0].ends_with(": ..........|..........|..........|..........|bbbbbbbbbb"));
    // The diagnostic's run of the kernel's tile of products (coop_diag_tile.wgsl), emulated:
    // every case right; and with the remainder part's products left out, case 1 named so.
    let tile = gpu.coop_diag_tile_emulated(|s| s.to_string()).unwrap();
    assert_eq!(tile.len(), 4);
    for l in &tile {
        println!("{l}");
        assert!(l.ends_with(": ok"), "{l}");
    }
    let tile = gpu
        .coop_diag_tile_emulated(|s| {
            let lo = "            c00 = coopMultiplyAdd(a0, l0, c00);\n";
            assert!(s.contains(lo));
            s.replace(lo, "")
        })
        .unwrap();
    println!("{}", tile[1]);
    assert!(tile[1].contains("WRONG: map x.x.|....;"), "{}", tile[1]);
    let tile = gpu
        .coop_diag_tile_emulated(|s| {
            s.replace("coopMultiplyAdd(a0, l0, c00)", "c00")
                .replace("coopMultiplyAdd(a0, l1, c01)", "c01")
                .replace("coopMultiplyAdd(a1, l0, c10)", "c10")
                .replace("coopMultiplyAdd(a1, l1, c11)", "c11")
        })
        .unwrap();
    println!("{}", tile[1]);
    assert!(
        tile[1].contains("WRONG: = A·Bt (hi part only, one step)"),
        "{}",
        tile[1]
    );
    // The variants that stage the operands differently from the kernel as written compute
    // the same (emulated; lavapipe is slow, so not all: the others change only strides, loop
    // form or the SPIR-V's memory words, which naga's validation in `coop_variants_validate`
    // and the real device's check at load cover): inputs read at staging, columns 32..63 in
    // arrays of their own, one invocation an item with no reads in flight and the k loop
    // unrolled, scalar f16 conversions.
    let checks = gpu.check_emulated_variants(&[3, 4, 7, 8]).unwrap();
    let names: Vec<&str> = checks.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "inputs read at staging",
            "columns 32..63 in arrays of their own",
            "no reads in flight, one invocation an item, k loop unrolled",
            "scalar f16 conversions"
        ]
    );
    for (name, e) in &checks {
        println!("variant {name} (emulated): {e:.2e}");
        assert!(*e < 1e-5, "variant {name} (emulated) differs by {e:.2e}");
    }
    let gs = gpu.new_seq(positions + 4).unwrap();
    let got = gpu.prefill_all_logits(gs, &tokens).unwrap();
    let e = rel_l2(&got, &want);
    println!("logits rel_l2 {e:.3e} over {positions} positions");
    assert!(e < 1e-3, "logits differ from the CPU by {e:.3e}");
}
