use super::*;

/// Random logits from a seeded generator (never zeros, never sorted).
fn random_logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = Xoshiro256::seeded(seed);
    (0..n)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

fn logits_for(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32 + 3.0).collect()
}

fn counts(params: SamplingParams, logits: &[f32], draws: usize) -> Vec<usize> {
    let mut s = Sampler::new(params);
    let mut c = vec![0usize; logits.len()];
    for _ in 0..draws {
        c[s.sample(logits) as usize] += 1;
    }
    c
}

fn params(temperature: f32, top_p: f32, top_k: u32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p,
        seed: 7,
        ..SamplingParams::greedy()
    }
}

/// |observed − expected| within 5 standard deviations of a binomial count.
fn assert_frequency(count: usize, draws: usize, p: f64, what: &str) {
    let expected = p * draws as f64;
    let sd = (draws as f64 * p * (1.0 - p)).sqrt().max(1.0);
    assert!(
        (count as f64 - expected).abs() <= 5.0 * sd,
        "{what}: {count} draws, expected {expected:.0} ± {:.0}",
        5.0 * sd
    );
}

#[test]
fn splitmix_and_xoshiro_match_reference_vectors() {
    // splitmix64 reference outputs for seed 1234567 (Vigna's splitmix64.c).
    let mut x: u64 = 1234567;
    let mut splitmix = || {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    assert_eq!(splitmix(), 6457827717110365317);
    assert_eq!(splitmix(), 3203168211198807973);
    let seeded = Xoshiro256::seeded(1234567);
    assert_eq!(seeded.s[0], 6457827717110365317);
    // xoshiro256** from state [1, 2, 3, 4] (reference xoshiro256starstar.c outputs).
    let mut r = Xoshiro256 { s: [1, 2, 3, 4] };
    assert_eq!(r.next_u64(), 11520);
    assert_eq!(r.next_u64(), 0);
    assert_eq!(r.next_u64(), 1509978240);
    assert_eq!(r.next_u64(), 1215971899390074240);
}

#[test]
fn top_k_one_is_greedy() {
    for seed in 0..20 {
        let logits = random_logits(5000, seed, 8.0);
        let want = argmax(&logits);
        for t in [0.3, 1.0, 2.0] {
            let mut s = Sampler::new(SamplingParams {
                seed: seed * 31 + 1,
                ..params(t, 1.0, 1, 0.0)
            });
            for _ in 0..5 {
                assert_eq!(s.sample(&logits), want);
            }
        }
        assert_eq!(Sampler::new(SamplingParams::greedy()).sample(&logits), want);
    }
}

#[test]
fn temperature_sampling_matches_softmax() {
    let logits = random_logits(6, 3, 2.0);
    for t in [0.5f32, 1.0, 1.7] {
        let draws = 40_000;
        let c = counts(params(t, 1.0, 0, 0.0), &logits, draws);
        let w: Vec<f64> = logits.iter().map(|&l| ((l / t) as f64).exp()).collect();
        let z: f64 = w.iter().sum();
        for (i, &n) in c.iter().enumerate() {
            assert_frequency(n, draws, w[i] / z, &format!("T={t} token {i}"));
        }
    }
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_the_mass() {
    // Sorted mass 0.5, 0.7, 0.85, 0.95, 1.0: top_p 0.8 keeps the first three.
    let probs = [0.1, 0.5, 0.05, 0.2, 0.15];
    let logits = logits_for(&probs);
    let draws = 30_000;
    let c = counts(params(1.0, 0.8, 0, 0.0), &logits, draws);
    assert_eq!(
        c[0] + c[2],
        0,
        "tokens outside the nucleus were drawn: {c:?}"
    );
    for i in [1, 3, 4] {
        assert_frequency(c[i], draws, probs[i] / 0.85, &format!("token {i}"));
    }
    // Exactly on the boundary the crossing token is kept: 0.7 → {1, 3}.
    let c = counts(params(1.0, 0.7, 0, 0.0), &logits, 5000);
    assert!(c[1] > 0 && c[3] > 0 && c[0] + c[2] + c[4] == 0, "{c:?}");
}

#[test]
fn top_k_keeps_the_k_best_with_renormalised_mass() {
    let logits = random_logits(50, 11, 3.0);
    let mut order: Vec<usize> = (0..50).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let draws = 30_000;
    let c = counts(params(1.0, 1.0, 3, 0.0), &logits, draws);
    let w: Vec<f64> = order[..3]
        .iter()
        .map(|&i| (logits[i] as f64).exp())
        .collect();
    let z: f64 = w.iter().sum();
    for (j, &i) in order[..3].iter().enumerate() {
        assert_frequency(c[i], draws, w[j] / z, &format!("rank {j}"));
    }
    assert_eq!(
        c.iter().sum::<usize>(),
        c[order[0]] + c[order[1]] + c[order[2]]
    );
}

#[test]
fn min_p_drops_tokens_below_the_fraction_of_the_best() {
    // Best 0.5: min_p 0.2 → floor 0.1 keeps 0.5, 0.3, 0.15; drops 0.05.
    let probs = [0.3, 0.05, 0.5, 0.15];
    let c = counts(params(1.0, 1.0, 0, 0.2), &logits_for(&probs), 20_000);
    assert_eq!(c[1], 0, "{c:?}");
    assert_frequency(c[2], 20_000, 0.5 / 0.95, "best token");
}

#[test]
fn presence_and_frequency_penalties_move_only_generated_tokens() {
    let logits = random_logits(10, 5, 1.0);
    let mut s = Sampler::new(SamplingParams {
        presence_penalty: 1.5,
        frequency_penalty: 0.25,
        ..SamplingParams::greedy()
    });
    for t in [3, 3, 3, 7] {
        s.accept(t);
    }
    let mut l = logits.clone();
    s.adjust(&mut l);
    for i in 0..10 {
        let want = match i {
            3 => logits[i] - 1.5 - 0.75,
            7 => logits[i] - 1.5 - 0.25,
            _ => logits[i],
        };
        assert!((l[i] - want).abs() < 1e-6, "token {i}: {} vs {want}", l[i]);
    }
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let logits = vec![2.0, -2.0, 1.0, -1.0, 0.5];
    let mut s = Sampler::with_prompt(
        SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        },
        &[0, 1],
    );
    s.accept(2);
    let mut l = logits.clone();
    s.adjust(&mut l);
    assert_eq!(l, vec![1.0, -4.0, 0.5, -1.0, 0.5]);
    // Token 0 is halved to 1.0 and still beats the untouched 0.5.
    assert_eq!(s.sample(&logits), 0);
}

#[test]
fn penalties_change_the_greedy_choice() {
    let logits = vec![1.0, 0.9, 0.1];
    let mut s = Sampler::new(SamplingParams {
        presence_penalty: 0.5,
        ..SamplingParams::greedy()
    });
    assert_eq!(s.sample(&logits), 0);
    s.accept(0);
    assert_eq!(s.sample(&logits), 1);
}

#[test]
fn logit_bias_forces_and_bans_tokens() {
    let logits = random_logits(1000, 9, 5.0);
    let best = argmax(&logits);
    let mut force = Sampler::new(SamplingParams {
        logit_bias: vec![(17, 100.0)],
        ..params(1.0, 1.0, 0, 0.0)
    });
    for _ in 0..50 {
        assert_eq!(force.sample(&logits), 17);
    }
    let mut ban = Sampler::new(SamplingParams {
        logit_bias: vec![(best, -100.0)],
        ..SamplingParams::greedy()
    });
    assert_ne!(ban.sample(&logits), best);
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let logits = random_logits(2000, 1, 4.0);
    let run = |seed: u64| {
        let mut s = Sampler::new(SamplingParams {
            seed,
            ..SamplingParams::model_defaults(true)
        });
        (0..64)
            .map(|_| {
                let t = s.sample(&logits);
                s.accept(t);
                t
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

#[test]
fn full_vocabulary_with_model_defaults_stays_in_the_top_20() {
    let logits = random_logits(248_320, 77, 10.0);
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let top: std::collections::HashSet<u32> = order[..20].iter().copied().collect();
    let mut s = Sampler::new(SamplingParams::model_defaults(false));
    // No `accept`: the presence penalty would (rightly) move a sampled token out of the top 20.
    for _ in 0..20 {
        assert!(top.contains(&s.sample(&logits)));
    }
}

#[test]
fn nan_and_empty_logits_do_not_panic() {
    let mut s = Sampler::new(params(1.0, 0.9, 0, 0.1));
    assert_eq!(s.sample(&[]), 0);
    assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN]), 1);
    assert_eq!(
        Sampler::new(SamplingParams::greedy()).sample(&[f32::NAN, 1.0]),
        1
    );
    let t = s.sample(&[f32::NAN; 4]);
    assert!(t < 4);
    let t = s.sample(&[f32::NEG_INFINITY; 4]);
    assert!(t < 4);
}

#[test]
fn model_defaults_follow_the_card() {
    let on = SamplingParams::model_defaults(true);
    assert_eq!(
        (on.temperature, on.top_p, on.top_k, on.min_p),
        (1.0, 0.95, 20, 0.0)
    );
    assert_eq!((on.presence_penalty, on.repetition_penalty), (1.5, 1.0));
    let off = SamplingParams::model_defaults(false);
    assert_eq!((off.temperature, off.top_p, off.top_k), (0.7, 0.8, 20));
    assert!(on.validate(248_320).is_ok() && off.validate(248_320).is_ok());
}

#[test]
fn validate_names_the_bad_field() {
    let bad = |f: fn(&mut SamplingParams)| {
        let mut p = SamplingParams::model_defaults(true);
        f(&mut p);
        p.validate(1000).unwrap_err()
    };
    assert!(bad(|p| p.temperature = 3.0).starts_with("temperature"));
    assert!(bad(|p| p.top_p = 0.0).starts_with("top_p"));
    assert!(bad(|p| p.min_p = f32::NAN).starts_with("min_p"));
    assert!(bad(|p| p.presence_penalty = -2.5).starts_with("presence_penalty"));
    assert!(bad(|p| p.repetition_penalty = 0.0).starts_with("repetition_penalty"));
    assert!(bad(|p| p.logit_bias = vec![(1000, 1.0)]).starts_with("logit_bias"));
    assert!(bad(|p| p.logit_bias = vec![(5, 101.0)]).starts_with("logit_bias"));
}

#[test]
fn left_out_fields_take_the_card_defaults() {
    let req = SamplingRequest {
        temperature: Some(0.2),
        seed: Some(5),
        ..Default::default()
    };
    let p = req.resolve(false, 99);
    assert_eq!((p.temperature, p.seed), (0.2, 5));
    assert_eq!((p.top_p, p.top_k, p.presence_penalty), (0.8, 20, 1.5));
    let p = SamplingRequest::default().resolve(true, 99);
    assert_eq!(
        p,
        SamplingParams {
            seed: 99,
            ..SamplingParams::model_defaults(true)
        }
    );
}

#[test]
fn nucleus_on_the_full_vocabulary_equals_a_plain_sort() {
    // The pre-filter that spares the full sort must not change the nucleus.
    for (seed, top_p, scale) in [
        (1, 0.95f32, 10.0f32),
        (2, 0.5, 3.0),
        (3, 0.999, 1.0),
        (4, 0.9, 25.0),
    ] {
        let logits = random_logits(248_320, seed, scale);
        let mut s = Sampler::new(params(1.0, top_p, 0, 0.0));
        s.fill_candidates(&logits);
        let mut got: Vec<u32> = s.candidates.iter().map(|e| e.0).collect();
        got.sort_unstable();
        // Reference: sort everything, softmax in f64, smallest prefix reaching top_p.
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let max = logits[order[0]] as f64;
        let w: Vec<f64> = order
            .iter()
            .map(|&i| (logits[i] as f64 - max).exp())
            .collect();
        let z: f64 = w.iter().sum();
        let mut mass = 0.0;
        let mut want = Vec::new();
        for (j, &i) in order.iter().enumerate() {
            want.push(i as u32);
            mass += w[j];
            if mass >= top_p as f64 * z {
                break;
            }
        }
        want.sort_unstable();
        // f32 vs f64 accumulation may move the boundary by one token at most.
        let diff = got.len().abs_diff(want.len());
        assert!(
            diff <= 1,
            "seed {seed}: {} vs {} tokens",
            got.len(),
            want.len()
        );
        let common = got.iter().filter(|t| want.binary_search(t).is_ok()).count();
        assert_eq!(common, got.len().min(want.len()), "seed {seed}");
    }
}

#[test]
fn next_uniform_is_the_draw_sample_makes_and_history_is_exposed() {
    let logits = random_logits(1000, 3, 4.0);
    let p = SamplingParams {
        repetition_penalty: 1.3,
        ..params(0.8, 0.9, 40, 0.0)
    };
    let mut a = Sampler::with_prompt(p.clone(), &[5, 9, 5]);
    let mut b = Sampler::with_prompt(p, &[5, 9, 5]);
    for _ in 0..5 {
        let t = a.sample(&logits);
        b.next_uniform();
        a.accept(t);
        b.accept(t);
    }
    // Same stream position after `sample` and after `next_uniform`.
    assert_eq!(a.next_uniform(), b.next_uniform());
    let mut counts: Vec<(u32, u32)> = a.output_counts().collect();
    counts.sort();
    assert_eq!(counts.iter().map(|c| c.1).sum::<u32>(), 5);
    let seen = a.seen_tokens();
    assert_eq!(&seen[..2], &[5, 9]);
    assert!(counts.iter().all(|(t, _)| seen.contains(t)));
    // Greedy draws nothing.
    let mut g = Sampler::new(SamplingParams::greedy());
    let mut h = Sampler::new(SamplingParams::greedy());
    g.sample(&logits);
    assert_eq!(g.next_uniform(), h.next_uniform());
}

/// Host cost per token of greedy decoding with penalties over the real vocabulary: what a device
/// backend pays when it samples on downloaded logits (the serving path's `temperature: 0` keeps
/// the model card's presence penalty). `cargo test --release -p lily-core host_greedy_cost --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn host_greedy_cost() {
    use std::time::Instant;
    let logits = random_logits(248_320, 11, 4.0);
    let time = |what: &str, f: &mut dyn FnMut() -> u32| {
        let n = 200;
        let mut sink = 0u32;
        let t = Instant::now();
        for _ in 0..n {
            sink = sink.wrapping_add(f());
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("{what}: {us:.0} µs/token ({sink})");
    };
    let mut plain = Sampler::new(SamplingParams::greedy());
    time("greedy, no penalty (sample)", &mut || plain.sample(&logits));
    let mut penalised = Sampler::new(SamplingParams {
        presence_penalty: 1.5,
        ..SamplingParams::greedy()
    });
    for t in 0..256 {
        penalised.accept(t * 7);
    }
    time("greedy, presence 1.5 (sample)", &mut || {
        penalised.sample(&logits)
    });
    time("log-softmax at one id (f64 sum)", &mut || {
        let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| ((l - mx) as f64).exp()).sum();
        (sum as u32) & 1
    });
    time("copy of the logits (1 MB)", &mut || {
        let v = logits.to_vec();
        v.len() as u32
    });
}

#[test]
fn argmax_matches_the_scalar_pass_with_ties_infinities_and_nan() {
    use proptest::prelude::*;
    let value = prop_oneof![
        (-4i32..4).prop_map(|v| v as f32),
        Just(f32::NAN),
        Just(f32::NEG_INFINITY),
        Just(f32::INFINITY),
    ];
    proptest!(|(xs in proptest::collection::vec(value, 0..70))| {
        prop_assert_eq!(argmax(&xs), argmax_scalar(&xs));
    });
    assert_eq!(argmax(&[]), 0);
    assert_eq!(argmax(&[f32::NAN; 3]), argmax_scalar(&[f32::NAN; 3]));
}

/// Allows only `allowed` and records what was committed.
struct OnlyThese {
    allowed: crate::constrain::TokenMask,
    committed: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
}

impl crate::constrain::TokenConstraint for OnlyThese {
    fn mask(&mut self) -> Option<&crate::constrain::TokenMask> {
        Some(&self.allowed)
    }
    fn commit(&mut self, token: u32) {
        self.committed.lock().unwrap().push(token);
    }
    fn stats(&self) -> crate::constrain::MaskStats {
        Default::default()
    }
}

#[test]
fn a_constraint_limits_picks_to_its_mask_and_hears_each_accepted_token() {
    let vocab = 500;
    let logits = random_logits(vocab, 5, 4.0);
    let allowed = [3u32, 77, 401];
    let committed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let constraint = |c: &std::sync::Arc<std::sync::Mutex<Vec<u32>>>| {
        Some(Box::new(OnlyThese {
            allowed: crate::constrain::TokenMask::only(vocab, &allowed),
            committed: c.clone(),
        }) as Box<dyn crate::constrain::TokenConstraint>)
    };
    // Greedy: the best allowed token, not the best overall.
    let mut greedy = Sampler::new(SamplingParams::greedy()).constrained(constraint(&committed));
    let best = *allowed
        .iter()
        .max_by(|a, b| logits[**a as usize].total_cmp(&logits[**b as usize]))
        .unwrap();
    assert_ne!(argmax(&logits), best);
    assert_eq!(greedy.sample(&logits), best);
    // Sampled with penalties and bias: always one of the allowed tokens.
    let mut p = SamplingParams::model_defaults(true);
    p.logit_bias = vec![(5, 100.0)];
    p.seed = 11;
    let mut s = Sampler::new(p).constrained(constraint(&committed));
    assert!(s.is_constrained());
    for _ in 0..200 {
        let t = s.sample(&logits);
        assert!(allowed.contains(&t), "{t}");
        s.accept(t);
    }
    assert_eq!(committed.lock().unwrap().len(), 200);
}

#[test]
fn device_history_counts_outputs_and_marks_what_the_repetition_penalty_covers() {
    let p = SamplingParams {
        repetition_penalty: 1.2,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::with_prompt(p, &[3, 9, 3]);
    for t in [5, 9, 5, 5, 70] {
        s.accept(t);
    }
    let h = s.device_history(10);
    assert_eq!(h.len(), 10);
    assert_eq!(h[3], HISTORY_SEEN); // prompt only
    assert_eq!(h[5], HISTORY_SEEN | 3);
    assert_eq!(h[9], HISTORY_SEEN | 1); // prompt and output
    assert_eq!(h[0], 0);
    // Without a repetition penalty nothing is marked seen; counts stay.
    let mut plain = Sampler::with_prompt(SamplingParams::greedy(), &[3]);
    plain.accept(5);
    plain.accept(5);
    let h = plain.device_history(10);
    assert_eq!((h[3], h[5]), (0, 2));
}

#[test]
fn sorted_logit_bias_drops_ids_outside_the_vocabulary_and_keeps_repeats_in_order() {
    let p = SamplingParams {
        logit_bias: vec![(7, 1.0), (2, -3.0), (99, 5.0), (7, -0.5), (0, 2.5)],
        ..SamplingParams::greedy()
    };
    assert_eq!(
        p.sorted_logit_bias(10),
        vec![(0, 2.5), (2, -3.0), (7, 1.0), (7, -0.5)]
    );
}

#[test]
fn the_history_stamp_names_the_sampler_and_counts_the_tokens_it_accepted() {
    let p = SamplingParams {
        repetition_penalty: 1.3,
        ..SamplingParams::model_defaults(false)
    };
    let mut a = Sampler::with_prompt(p.clone(), &[4, 8]);
    let b = Sampler::with_prompt(p, &[4, 8]);
    let (sa, sb) = (a.history_stamp(), b.history_stamp());
    // Two samplers of the same request are still two histories.
    assert_ne!(sa.sampler, sb.sampler);
    assert_eq!((sa.accepted, sb.accepted), (0, 0));
    // Drawing and sampling leave the history (and so the stamp) as it was; each accepted token
    // moves it on by one, as it moves the history a device copy would have to follow.
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 23) as f32 * 0.3).collect();
    let _ = a.next_uniform();
    let t = a.sample(&logits);
    assert_eq!(a.history_stamp(), sa);
    let before = a.device_history(50);
    a.accept(t);
    a.accept(t);
    assert_eq!(
        a.history_stamp(),
        HistoryStamp {
            sampler: sa.sampler,
            accepted: 2
        }
    );
    assert_ne!(a.device_history(50), before);
}
