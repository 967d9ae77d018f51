//! Pipelined decode (`CudaOptions::pipelined_decode`) and the page-locked copies it reads tokens by.

use crate::common::*;

/// `pinned::Pinned` (pipelined decode's token read and mask upload): words written from page-locked
/// memory arrive exactly; a read queued behind other work sees that work (a device copy, a fill,
/// no stream sync between them), on the GPU's stream or a side stream; the staging words are
/// reused once their copy has landed; copies out of range are refused.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pinned_host_copies_are_stream_ordered() {
    let g = Gpu::open(0, Default::default()).expect("a CUDA GPU and NVRTC");
    let mut rng = Rng(41);
    let words: Vec<u32> = (0..1000).map(|_| rng.next() as u32 | 1).collect();
    let (a, b) = (g.alloc(4000).unwrap(), g.alloc(4000).unwrap());
    let mut up = Pinned::new(&g, 1000).unwrap();
    let mut down = Pinned::new(&g, 1000).unwrap();
    up.queue_write(&g, &words, &a, 0).unwrap();
    g.copy(&b, 0, &a, 0, 4000).unwrap();
    down.queue_read(&g, &b, 0, 1000).unwrap();
    assert_eq!(down.wait(1000).unwrap(), &words[..]);
    g.fill(&b, 0xab).unwrap();
    down.queue_read(&g, &b, 8, 2).unwrap();
    assert_eq!(down.wait(2).unwrap(), &[0xabab_abab, 0xabab_abab]);
    let again: Vec<u32> = words.iter().map(|w| w.rotate_left(7)).collect();
    up.queue_write(&g, &again, &a, 0).unwrap();
    up.queue_write(&g, &again[..10], &a, 400).unwrap();
    assert_eq!(g.read::<u32>(&a, 0, 1000).unwrap()[..100], again[..100]);
    assert_eq!(g.read::<u32>(&a, 400, 10).unwrap(), again[..10]);
    assert!(down.queue_read(&g, &b, 3996, 2).is_err());
    assert!(down.queue_read(&g, &b, 0, 1001).is_err());
    assert!(up.queue_write(&g, &words, &a, 4).is_err());
    // A side-stream read (pipelined decode's token) starts where the GPU's stream has reached:
    // it sees a copy and a fill queued before it there, with no stream sync between them.
    let mut side = Pinned::with_side_stream(&g, 1000).unwrap();
    for round in 0..20u32 {
        let byte = 0x11 * (round % 15 + 1) as u8;
        g.copy(&b, 0, &a, 0, 4000).unwrap();
        g.fill(&b, byte).unwrap();
        g.copy(&b, 400, &a, 400, 40).unwrap();
        side.queue_read(&g, &b, 0, 1000).unwrap();
        let got = side.wait(1000).unwrap();
        let fill = u32::from_ne_bytes([byte; 4]);
        assert!(got[..100].iter().all(|&w| w == fill), "round {round}");
        assert_eq!(got[100..110], again[..10], "round {round}");
        assert!(got[110..].iter().all(|&w| w == fill), "round {round}");
    }
    println!(
        "KERNEL pinned host copies: 1,000 words each way, stream-ordered, also from a side stream"
    );
}

/// A decode-test backend on `w`, pipelined or not, the environment ignored (so
/// LILY_PIPELINED_DECODE cannot turn the comparison into one path against itself).
fn pipeline_backend(w: &ModelWeights, pipelined: bool, bf16_activations: bool) -> CudaBackend {
    let b = CudaBackend::with_options(
        w,
        &CudaOptions {
            bf16_activations,
            chunk: 16,
            pipelined_decode: pipelined,
            ..CudaOptions::default()
        },
    )
    .unwrap();
    assert_eq!(
        b.plan()
            .pipelined_decode(SamplingPath::DeviceGreedy, LogprobsPath::None),
        pipelined
    );
    b
}

/// Pipelined decode reports exactly the unpipelined tokens and log-probabilities and leaves the
/// sequence at the same length: greedy, seeded sampling (temperature, top_k, top_p, penalties:
/// the uniform and the device history per pick), constrained greedy and sampled (a random mask
/// per step, uploaded from page-locked memory while the forward pass runs), top log-probabilities
/// (pipelining off for them by the plan) and host sampling (top_k 0, likewise); two decode calls
/// each (the second rebuilds the device sampler), fp32 exactly and the shipping bf16 path.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pipelined_decode_reports_the_unpipelined_tokens() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 21);
    let vocab = w.config.vocab;
    let mut rng = Rng(31);
    let prompt = rng.tokens(24, vocab);
    let sampled = sampled_params(4242);
    let host = host_sampled_params(7);
    // (name, params, constrained, top_logprobs)
    let cases: [(&str, &SamplingParams, bool, usize); 6] = [
        ("greedy", &SamplingParams::greedy(), false, 0),
        ("sampled", &sampled, false, 0),
        ("constrained greedy", &SamplingParams::greedy(), true, 0),
        ("constrained sampled", &sampled, true, 0),
        ("greedy top_logprobs 4", &SamplingParams::greedy(), false, 4),
        ("host sampling", &host, false, 0),
    ];
    for (bf16_activations, lp_tol) in [(false, 0.0), (true, 1e-3)] {
        let run = |pipelined: bool,
                   params: &SamplingParams,
                   constrained: bool,
                   top: usize|
         -> (Reported, Vec<usize>) {
            let mut b = pipeline_backend(&w, pipelined, bf16_activations);
            let s = b.new_seq(128).unwrap();
            b.prefill(s, &prompt).unwrap();
            let constraint = constrained.then(|| {
                Box::new(RandomMask::new(vocab, 9, &prompt[..8])) as Box<dyn TokenConstraint>
            });
            let mut sampler = Sampler::with_prompt(params.clone(), &prompt).constrained(constraint);
            let (mut all, mut lens) = (Vec::new(), Vec::new());
            for n in [13, 9] {
                let (out, r) = decode_into(&mut b, s, &mut sampler, n, top, None);
                r.unwrap();
                assert_eq!(out.len(), n);
                all.extend(out);
                lens.push(b.seq_len(s).unwrap());
            }
            (all, lens)
        };
        for (name, params, constrained, top) in cases {
            let what = format!("{name} (bf16 activations {bf16_activations})");
            let (want, want_lens) = run(false, params, constrained, top);
            let (got, got_lens) = run(true, params, constrained, top);
            same_reported(
                &format!("pipelined vs unpipelined, {what}"),
                &got,
                &want,
                lp_tol,
            );
            // n tokens reported, n - 1 fed, each call.
            assert_eq!(
                want_lens,
                vec![prompt.len() + 12, prompt.len() + 20],
                "{what}"
            );
            assert_eq!(got_lens, want_lens, "{what}: sequence lengths");
            println!(
                "MODEL pipelined decode == unpipelined: {what}, {} tokens",
                got.len()
            );
        }
    }
}

/// A `Flow::Stop` at the k-th token of a pipelined decode leaves that token fed (`seq_len` =
/// prompt + k, the logits those after it), and the next decode goes on exactly as an
/// unpipelined run that was fed the same tokens (its stopping token fed by a prefill); greedy
/// and seeded sampling (the random stream and the device history carry over), where both
/// equal one uninterrupted decode. A stop at the n-th token, and n = 1, feed nothing.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_stop_in_pipelined_decode_leaves_the_token_fed_and_decode_resumes_after_it() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 22);
    let vocab = w.config.vocab;
    let mut rng = Rng(32);
    let prompt = rng.tokens(20, vocab);
    let sampled = SamplingParams {
        temperature: 1.0,
        top_k: 40,
        top_p: 0.95,
        frequency_penalty: 0.5,
        seed: 99,
        ..SamplingParams::greedy()
    };
    let p = prompt.len();
    for (name, params) in [("greedy", SamplingParams::greedy()), ("sampled", sampled)] {
        let k = 5;
        // One uninterrupted unpipelined decode of 12.
        let mut plain = pipeline_backend(&w, false, false);
        let s = plain.new_seq(64).unwrap();
        plain.prefill(s, &prompt).unwrap();
        let mut sampler = Sampler::with_prompt(params.clone(), &prompt);
        let (whole, r) = decode_into(&mut plain, s, &mut sampler, 12, 0, None);
        r.unwrap();
        drop(plain);

        // Pipelined: stop at the k-th of at most 12, then 7 more.
        let mut piped = pipeline_backend(&w, true, false);
        let s = piped.new_seq(64).unwrap();
        piped.prefill(s, &prompt).unwrap();
        let mut sampler = Sampler::with_prompt(params.clone(), &prompt);
        let (first, r) = decode_into(&mut piped, s, &mut sampler, 12, 0, Some(k));
        r.unwrap();
        assert_eq!(first.len(), k, "{name}");
        assert_eq!(
            piped.seq_len(s).unwrap(),
            p + k,
            "{name}: the stopping token was fed"
        );
        let piped_logits = piped.logits(s).unwrap();
        let (rest, r) = decode_into(&mut piped, s, &mut sampler, 7, 0, None);
        r.unwrap();
        assert_eq!(piped.seq_len(s).unwrap(), p + k + 6, "{name}");

        // Unpipelined: the same stop leaves the token unfed; a prefill feeds it.
        let mut unpiped = pipeline_backend(&w, false, false);
        let s = unpiped.new_seq(64).unwrap();
        unpiped.prefill(s, &prompt).unwrap();
        let mut sampler = Sampler::with_prompt(params.clone(), &prompt);
        let (ufirst, r) = decode_into(&mut unpiped, s, &mut sampler, 12, 0, Some(k));
        r.unwrap();
        assert_eq!(
            unpiped.seq_len(s).unwrap(),
            p + k - 1,
            "{name}: unpipelined"
        );
        unpiped.prefill(s, &[ufirst[k - 1].0]).unwrap();
        check(
            &format!("{name}: logits after the stopping token, pipelined vs fed by a prefill"),
            &piped_logits,
            &unpiped.logits(s).unwrap(),
            1e-6,
        );
        let (urest, r) = decode_into(&mut unpiped, s, &mut sampler, 7, 0, None);
        r.unwrap();
        same_reported(&format!("{name}: before the stop"), &first, &ufirst, 0.0);
        // The same kernels feed the token either way (a one-token prefill is the decode step's
        // forward pass); the bound only leaves room for a launch-order difference.
        same_reported(&format!("{name}: after the stop"), &rest, &urest, 1e-6);
        let joined: Reported = first.iter().chain(&rest).cloned().collect();
        same_reported(
            &format!("{name}: stopped and resumed vs one decode"),
            &joined,
            &whole,
            0.0,
        );

        // A stop at the n-th token, and n = 1: nothing fed (the last allowed token never is).
        let s = piped.new_seq(64).unwrap();
        piped.prefill(s, &prompt).unwrap();
        let mut sampler = Sampler::with_prompt(params.clone(), &prompt);
        let (out, r) = decode_into(&mut piped, s, &mut sampler, 4, 0, Some(4));
        r.unwrap();
        assert_eq!((out.len(), piped.seq_len(s).unwrap()), (4, p + 3), "{name}");
        let (one, r) = decode_into(&mut piped, s, &mut sampler, 1, 0, None);
        r.unwrap();
        assert_eq!(
            (one.len(), piped.seq_len(s).unwrap()),
            (1, p + 3),
            "{name}: n = 1"
        );
        // The n = 1 call picked from the same pending logits as the stop's 4th: greedy repeats
        // it.
        if name == "greedy" {
            assert_eq!(one[0].0, out[3].0, "{name}: n = 1 after a stop at the n-th");
        }
        println!("MODEL pipelined decode: a stop at token {k} leaves it fed, and decode resumes as unpipelined ({name})");
    }
}

/// Pipelined decode at a full context: no step past it is queued, and it ends as unpipelined
/// decode does: the tokens that fit reported, then the context-full error (or a clean stop at
/// the last that fits), the sequence full.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pipelined_decode_stops_at_a_full_context_as_unpipelined() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 23);
    let vocab = w.config.vocab;
    let mut rng = Rng(33);
    let prompt = rng.tokens(20, vocab);
    let p = prompt.len();
    let mut results = Vec::new();
    for pipelined in [false, true] {
        let mut b = pipeline_backend(&w, pipelined, false);
        // Room for 3 generated tokens to be fed.
        let s = b.new_seq(p + 3).unwrap();
        b.prefill(s, &prompt).unwrap();
        let (out, r) = decode_into(
            &mut b,
            s,
            &mut Sampler::new(SamplingParams::greedy()),
            10,
            0,
            None,
        );
        let e = r
            .expect_err("a full context ends decode with an error")
            .to_string();
        assert!(e.contains("context") && e.contains("full"), "{e}");
        assert_eq!(
            (out.len(), b.seq_len(s).unwrap()),
            (4, p + 3),
            "pipelined {pipelined}"
        );
        // Stopping at the 4th token (the one that no longer fits) is no error.
        let s2 = b.new_seq(p + 3).unwrap();
        b.prefill(s2, &prompt).unwrap();
        let (out2, r) = decode_into(
            &mut b,
            s2,
            &mut Sampler::new(SamplingParams::greedy()),
            10,
            0,
            Some(4),
        );
        r.unwrap();
        assert_eq!(
            (out2.len(), b.seq_len(s2).unwrap()),
            (4, p + 3),
            "pipelined {pipelined}"
        );
        same_reported(
            &format!("pipelined {pipelined}: stopped vs failed"),
            &out2,
            &out,
            0.0,
        );
        results.push(out);
    }
    same_reported(
        "full context, pipelined vs unpipelined",
        &results[1],
        &results[0],
        0.0,
    );
    println!("MODEL pipelined decode at a full context: 4 tokens, then the error, as unpipelined");
}

/// Top log-probabilities from CUDA decode equal the CPU backend's (fp32, tiny model, 12 tokens,
/// greedy and seeded sampling, k = 1, 5 and 20), computed on the device (the default, pipelined)
/// and on the host (`device_logprobs` off, unpipelined). The device path against the host path
/// on the same backend's logits (fp32 kernels repeat bit for bit, pipelined or not): ids equal,
/// log-probabilities within 1e-5. Both against the CPU: tokens equal, log-probabilities within
/// 1e-3 (the fp32 model's own drift over 12 decode steps: 1.3e-4 measured on the H200),
/// alternatives' ids equal except where the CPU's neighbours are within that of each other.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn top_logprobs_in_decode_equal_the_cpus() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 23);
    let vocab = w.config.vocab;
    let mut rng = Rng(33);
    let prompt = rng.tokens(24, vocab);
    let sampled = SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.95,
        seed: 77,
        ..SamplingParams::greedy()
    };
    let ids = |r: &Reported| r.iter().map(|t| t.0).collect::<Vec<_>>();
    for (name, params) in [("greedy", SamplingParams::greedy()), ("sampled", sampled)] {
        for k in [1usize, 5, 20] {
            let run = |b: &mut dyn Backend| -> Reported {
                let s = b.new_seq(64).unwrap();
                b.prefill(s, &prompt).unwrap();
                let mut sampler = Sampler::with_prompt(params.clone(), &prompt);
                let mut out = Vec::new();
                b.decode(s, &mut sampler, 12, k, &mut |o| {
                    out.push((o.token, o.logprob, o.top.clone()));
                    Flow::Continue
                })
                .unwrap();
                out
            };
            let cpu = run(&mut CpuBackend::new(w.clone()));
            let cuda = |device: bool| -> Reported {
                let mut b = CudaBackend::with_options(
                    &w,
                    &CudaOptions {
                        bf16_activations: false,
                        chunk: 16,
                        device_logprobs: device,
                        ..CudaOptions::default()
                    },
                )
                .unwrap();
                let path = b.plan().sampling(&params);
                let lp_path = b.plan().logprobs(path, k, vocab);
                assert_eq!(lp_path == LogprobsPath::Device, device);
                assert_eq!(b.plan().pipelined_decode(path, lp_path), device);
                run(&mut b)
            };
            let (dev, host) = (cuda(true), cuda(false));
            let what = format!("{name} k {k}");
            same_reported(&format!("{what}: device vs host path"), &dev, &host, 1e-5);
            assert_eq!(ids(&dev), ids(&cpu), "{what}: tokens vs the CPU's");
            let tol = 1e-3f32;
            let mut worst = 0f32;
            for (i, (g, c)) in dev.iter().zip(&cpu).enumerate() {
                assert!(
                    (g.1 - c.1).abs() < tol,
                    "{what}: token {i}: {} vs {}",
                    g.1,
                    c.1
                );
                assert_eq!(g.2.len(), k, "{what}: token {i}: alternatives");
                assert_eq!(c.2.len(), k, "{what}: token {i}: cpu alternatives");
                for r in 0..k {
                    let ((gi, gl), (ci, cl)) = (g.2[r], c.2[r]);
                    worst = worst.max((gl - cl).abs());
                    let near_tie = (r > 0 && (c.2[r - 1].1 - cl).abs() < tol)
                        || (r + 1 < k && (c.2[r + 1].1 - cl).abs() < tol)
                        || r + 1 == k; // the CPU's k+1-th may tie its k-th
                    assert!(
                        (gl - cl).abs() < tol && (gi == ci || near_tie),
                        "{what}: token {i} rank {r}: {:?} vs {:?}",
                        g.2,
                        c.2
                    );
                }
            }
            println!("MODEL top_logprobs {what}: device == host path, 12 tokens equal the CPU's, worst alternative logprob diff {worst:.2e}");
        }
    }
}
