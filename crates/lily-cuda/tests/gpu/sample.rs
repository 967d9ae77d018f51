//! sample.cu and the device sampler: argmax, sampled and constrained picks against the host sampler.

use crate::common::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn argmax_and_logprob_match_cpu() {
    let g = gpu();
    let mut rng = Rng(8);
    let vocab = 248_320;
    let mut logits = rng.vec(vocab, 4.0);
    let planted = 123_457;
    logits[planted] = 9.5;
    let dl = g.upload(&logits).unwrap();
    let (dt, dlp) = (poisoned(&g, 1), poisoned(&g, 1));
    // Reference log-softmax in f64: a sequential f32 sum over 248K terms drifts by ~1e-4.
    let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = mx
        + logits
            .iter()
            .map(|&l| (l as f64 - mx).exp())
            .sum::<f64>()
            .ln();
    let want_lp = (logits[planted] as f64 - lse) as f32;
    let (cpu_lp, _) = lily_core::logprob::token_logprob(&logits, planted as u32, 0);
    // One block, and the two-stage form decode uses (per-block partials, then a final block).
    let parts = poisoned(&g, lily_cuda::kernels::sample::ARGMAX_SCRATCH);
    for partials in [None, Some(parts.ptr)] {
        g.fill(&dt, 0xff).unwrap();
        g.fill(&dlp, 0xff).unwrap();
        let argmax = Argmax {
            logits: dl.ptr,
            vocab,
            token_out: dt.ptr,
            logprob_out: dlp.ptr,
            partials,
        };
        g.k.sample.argmax_logprob(&g, &argmax).unwrap();
        let id: Vec<i32> = g.read(&dt, 0, 1).unwrap();
        let lp: Vec<f32> = g.read(&dlp, 0, 1).unwrap();
        assert_eq!(id[0] as usize, planted, "two-stage: {}", partials.is_some());
        assert!(
            (lp[0] - want_lp).abs() < 2e-5,
            "logprob {} vs {want_lp} (f64), two-stage: {}",
            lp[0],
            partials.is_some()
        );
        println!(
            "KERNEL argmax_logprob (two-stage: {}): id {} logprob {} (f64 {want_lp}, cpu backend {cpu_lp})",
            partials.is_some(),
            id[0],
            lp[0]
        );
    }
}

/// Log-softmax of `logits` at `id`, in f64.
fn log_softmax_f64(logits: &[f32], id: usize) -> f64 {
    let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = mx
        + logits
            .iter()
            .map(|&l| (l as f64 - mx).exp())
            .sum::<f64>()
            .ln();
    logits[id] as f64 - lse
}

/// Device sampling (sample.cu) picks exactly the host `Sampler`'s tokens: same seed, same
/// history, fresh random logits for each of 200 draws per parameter set, free and constrained
/// (a random token mask per step); the reported log-probability is the raw logits'
/// log-softmax. A few "hot" tokens are boosted in every draw so the penalties keep hitting
/// tokens inside the top k.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sampling_on_device_picks_the_host_samplers_tokens() {
    let g = gpu();
    let vocab = 248_320;
    let draws = 200;
    let mut rng = Rng(21);
    let hot = rng.tokens(30, vocab);
    let prompt: Vec<u32> = hot[..10]
        .iter()
        .copied()
        .chain((0..50).map(|_| rng.below(vocab) as u32))
        .collect();
    let base = SamplingParams {
        seed: 1234,
        ..SamplingParams::greedy()
    };
    let cold = rng.below(vocab) as u32;
    let sets: Vec<(&str, SamplingParams, bool)> = vec![
        (
            "top_k 20, top_p 0.95, T 1.0",
            SamplingParams {
                temperature: 1.0,
                top_k: 20,
                top_p: 0.95,
                ..base.clone()
            },
            false,
        ),
        (
            "top_k 40, T 0.7, min_p 0.05",
            SamplingParams {
                temperature: 0.7,
                top_k: 40,
                min_p: 0.05,
                seed: 99,
                ..base.clone()
            },
            false,
        ),
        (
            "penalties with a history (presence 1.5, frequency 0.5, repetition 1.3)",
            SamplingParams {
                temperature: 0.8,
                top_k: 50,
                top_p: 0.9,
                presence_penalty: 1.5,
                frequency_penalty: 0.5,
                repetition_penalty: 1.3,
                seed: 7,
                ..base.clone()
            },
            false,
        ),
        (
            "logit_bias (incl. a repeated id) + top_k 256, top_p 0.8",
            SamplingParams {
                temperature: 1.0,
                top_k: 256,
                top_p: 0.8,
                logit_bias: vec![
                    (hot[0], -100.0),
                    (hot[1], 3.5),
                    (cold, 4.0),
                    (hot[2], 1.25),
                    (hot[1], -0.75),
                ],
                seed: 5,
                ..base.clone()
            },
            false,
        ),
        (
            "model defaults (thinking)",
            SamplingParams {
                seed: 42,
                ..SamplingParams::model_defaults(true)
            },
            false,
        ),
        (
            "greedy with presence 1.5 and repetition 1.3 (top 1 of the adjusted logits, no uniform drawn)",
            SamplingParams {
                presence_penalty: 1.5,
                repetition_penalty: 1.3,
                seed: 11,
                ..base.clone()
            },
            false,
        ),
        (
            "greedy with logit_bias, on a coarse grid (ties go to the lower id)",
            SamplingParams {
                logit_bias: vec![(hot[3], 0.5), (cold, 1.0)],
                seed: 12,
                ..base.clone()
            },
            true,
        ),
        (
            "ties: logits on a coarse grid, top_k 40 cuts inside a tie",
            SamplingParams {
                temperature: 1.0,
                top_k: 40,
                seed: 3,
                ..base.clone()
            },
            true,
        ),
    ];
    // Every set once free and once constrained (a fresh random mask each step, applied on the
    // device to the adjusted logits, on the host by `Sampler::sample`).
    let sets: Vec<(String, SamplingParams, bool, bool)> = sets
        .into_iter()
        .flat_map(|(n, p, c)| {
            [
                (n.to_string(), p.clone(), c, false),
                (format!("{n}, constrained"), p, c, true),
            ]
        })
        .collect();
    // Each set on the many-block pick (sample_part + sample_pick_parts, the default), on the
    // one-block sample_pick, and on the many-block pick with the warp-scan radix select
    // (sample.cu built with SAMPLE_WARP_SCAN, the plan's `warp_scan_sampling`).
    let gw = dev_with(CudaOptions {
        warp_scan_sampling: true,
        ..kernel_test_options(false)
    });
    let sets: Vec<(String, SamplingParams, bool, bool, bool, bool)> = sets
        .into_iter()
        .flat_map(|(n, p, c, m)| {
            [
                (n.clone(), p.clone(), c, m, true, false),
                (format!("{n}, one block"), p.clone(), c, m, false, false),
                (format!("{n}, warp scan"), p, c, m, true, true),
            ]
        })
        .collect();
    for (name, params, coarse, constrained, parts, warp) in sets {
        let g: &Dev = if warp { &gw } else { &g };
        let dl = g.alloc(vocab * 4).unwrap();
        let dw = g.alloc(vocab.div_ceil(32) * 4).unwrap();
        let (dt, dlp) = (poisoned(g, 1), poisoned(g, 1));
        let constraint = |seed| -> Option<Box<dyn TokenConstraint>> {
            constrained
                .then(|| Box::new(RandomMask::new(vocab, seed, &hot)) as Box<dyn TokenConstraint>)
        };
        let mut host = Sampler::with_prompt(params.clone(), &prompt).constrained(constraint(91));
        let mut dev = Sampler::with_prompt(params.clone(), &prompt).constrained(constraint(91));
        // Some output history before the device state is built from the sampler.
        for &t in &hot[5..9] {
            host.accept(t);
            dev.accept(t);
        }
        let ds = DeviceSampler::new(g, vocab, &dev, parts).unwrap();
        let mut worst_lp = 0f64;
        let mut distinct = std::collections::HashSet::new();
        for draw in 0..draws {
            let mut logits = rng.vec(vocab, 4.0);
            for &t in &hot {
                logits[t as usize] = 6.0 + rng.val(1.0).abs();
            }
            if coarse {
                // Few distinct values: many equal logits around the k-th place.
                for l in logits.iter_mut() {
                    *l = (*l * 2.0).round() / 2.0 + 0.25;
                }
            }
            g.write(&dl, 0, &logits).unwrap();
            let mask = dev.next_mask().map(|m| m.words().to_vec());
            if let Some(words) = &mask {
                g.write(&dw, 0, words).unwrap();
            }
            ds.sample(
                g,
                &g.k.sample,
                &mut dev,
                dl.ptr,
                dt.ptr,
                dlp.ptr,
                mask.map(|_| dw.ptr),
            )
            .unwrap();
            let id: Vec<i32> = g.read(&dt, 0, 1).unwrap();
            let lp: Vec<f32> = g.read(&dlp, 0, 1).unwrap();
            let want = host.sample(&logits);
            assert_eq!(
                id[0] as u32, want,
                "{name}: draw {draw}: device token {} != host token {want}",
                id[0]
            );
            let want_lp = log_softmax_f64(&logits, want as usize);
            let d = (lp[0] as f64 - want_lp).abs();
            worst_lp = worst_lp.max(d);
            assert!(
                d < 1e-4,
                "{name}: draw {draw}: logprob {} vs {want_lp}",
                lp[0]
            );
            host.accept(want);
            dev.accept(want);
            distinct.insert(want);
        }
        println!(
            "SAMPLING {name}: {draws}/{draws} tokens equal the host sampler's ({} distinct), worst logprob diff {worst_lp:.2e}",
            distinct.len()
        );
        assert!(distinct.len() > 1, "{name}: the draws never varied");
    }
}

/// `CudaBackend::decode` with device sampling gives the tokens and log-probabilities of the
/// host-sampling path (--no-device-sampling), with graphs on and off.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sampling_in_decode_equals_the_host_path() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 13);
    let vocab = w.config.vocab;
    let mut rng = Rng(6);
    let prompt = rng.tokens(24, vocab);
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 20,
        top_p: 0.95,
        presence_penalty: 1.5,
        repetition_penalty: 1.1,
        seed: 77,
        ..SamplingParams::greedy()
    };
    let greedy = SamplingParams {
        seed: 78,
        ..SamplingParams::greedy()
    };
    let run = |params: &SamplingParams,
               constrained: bool,
               device_sampling: bool,
               graphs: bool|
     -> Vec<(u32, f32)> {
        let mut b = CudaBackend::new(
            &w,
            CudaOptions {
                bf16_activations: false,
                chunk: 16,
                graphs,
                split_kv: false,
                device_sampling,
                ..CudaOptions::default()
            },
        )
        .unwrap();
        let s = b.new_seq(128).unwrap();
        b.prefill(s, &prompt).unwrap();
        let constraint = constrained
            .then(|| Box::new(RandomMask::new(vocab, 5, &prompt[..8])) as Box<dyn TokenConstraint>);
        let mut sampler = Sampler::with_prompt(params.clone(), &prompt).constrained(constraint);
        let mut out = Vec::new();
        // Two decode calls: the second rebuilds the device history from the sampler.
        for _ in 0..2 {
            b.decode(s, &mut sampler, 16, 0, &mut |o| {
                out.push((o.token, o.logprob));
                Flow::Continue
            })
            .unwrap();
        }
        out
    };
    for (what, p) in [("temperature", &params), ("greedy", &greedy)] {
        for constrained in [false, true] {
            let host = run(p, constrained, false, false);
            for graphs in [false, true] {
                let dev = run(p, constrained, true, graphs);
                assert_eq!(dev.len(), host.len());
                for (i, (d, h)) in dev.iter().zip(&host).enumerate() {
                    assert_eq!(
                        d.0, h.0,
                        "{what} constrained {constrained} graphs {graphs}: token {i}: device {dev:?} host {host:?}"
                    );
                    assert!(
                        (d.1 - h.1).abs() < 1e-4,
                        "{what} constrained {constrained} graphs {graphs}: logprob {i}: {} vs {}",
                        d.1,
                        h.1
                    );
                }
            }
            println!(
                "MODEL decode with device sampling == host sampling ({what}, constrained {constrained}: {} tokens, graphs on and off)",
                host.len()
            );
        }
    }
}

// ---- whole model -------------------------------------------------------------------------

/// Device top log-probabilities (logprob_part + logprob_final) against lily_core::logprob on
/// random 248,320-entry rows with planted ties (equal logits, -0.0 beside 0.0, a tie across the
/// k-th place and across two blocks' slices): ids equal, log-probabilities within 1e-5 of the
/// host's (its log-sum-exp summed in f64), for k = 1, 5, 20; and the k a launch refuses.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn top_logprobs_on_device_match_the_host() {
    let g = gpu();
    let vocab = 248_320;
    let parts = poisoned(&g, LOGPROB_SCRATCH_WORDS);
    let out = poisoned(&g, 2 * LOGPROB_MAX_K);
    let mut worst = 0f32;
    for seed in 0..4u64 {
        let mut rng = Rng(100 + seed);
        let mut logits = rng.vec(vocab, 4.0);
        // A cluster of equal maxima spread over several blocks' slices (ties to the lower id),
        // more of them than places at k = 5, and a signed zero pair near the top in seed 3.
        let top = 11.0 + seed as f32;
        for &i in &[200_001usize, 7, 123_456, 1_940, 1_941, 77_777, 248_319] {
            logits[i] = top;
        }
        for &i in &[5_000usize, 3, 240_000] {
            logits[i] = top - 0.5;
        }
        if seed == 3 {
            for l in logits.iter_mut() {
                *l -= top + 1.0; // every logit negative, the largest -1
            }
            logits[9] = 0.0;
            logits[10] = -0.0;
            logits[8] = 0.0;
        }
        let dl = g.upload(&logits).unwrap();
        let ls = lily_core::logprob::LogSoftmax::new(&logits);
        for k in [1usize, 5, 20] {
            g.fill(&out, 0xff).unwrap();
            g.k.sample
                .top_logprobs(
                    &g,
                    &TopLogprobs {
                        logits: dl.ptr,
                        vocab,
                        k,
                        parts: parts.ptr,
                        out: out.ptr,
                    },
                )
                .unwrap();
            let w: Vec<u32> = g.read(&out, 0, 2 * k).unwrap();
            let got: Vec<(u32, f32)> = w
                .chunks_exact(2)
                .map(|p| (p[0], f32::from_bits(p[1])))
                .collect();
            let want = ls.top(k);
            assert_eq!(
                got.iter().map(|t| t.0).collect::<Vec<_>>(),
                want.iter().map(|t| t.0).collect::<Vec<_>>(),
                "seed {seed} k {k}: ids"
            );
            for ((_, a), (id, b)) in got.iter().zip(&want) {
                // The f64 reference too: the host's value is itself within 1e-6 of it.
                let exact = log_softmax_f64(&logits, *id as usize) as f32;
                assert!(
                    (a - b).abs() < 1e-5,
                    "seed {seed} k {k} id {id}: {a} vs host {b}"
                );
                assert!(
                    (a - exact).abs() < 1e-5,
                    "seed {seed} k {k} id {id}: {a} vs f64 {exact}"
                );
                worst = worst.max((a - b).abs());
            }
        }
    }
    for bad in [0usize, LOGPROB_MAX_K + 1] {
        let a = TopLogprobs {
            logits: out.ptr,
            vocab,
            k: bad,
            parts: parts.ptr,
            out: out.ptr,
        };
        assert!(g.k.sample.top_logprobs(&g, &a).is_err(), "k {bad}");
    }
    println!("KERNEL top_logprobs: k 1/5/20 on 4 rows of 248,320 with ties equal the host's ids, worst logprob diff {worst:.2e}");
}
