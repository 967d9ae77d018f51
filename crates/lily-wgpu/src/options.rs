//! `WgpuOptions`: how the wgpu backend is asked to run, declared once. Each switch, knob and
//! text option is one row of the table below (`lily_core::backend_options!`, the macro lily-cuda's
//! `CudaOptions` is declared with too), which gives its field, the value that ships, its
//! `lily-engine` flag (lily-server builds its `--wgpu-*` flags from `SWITCHES`, `KNOBS` and
//! `TEXTS`, no code per option there), its environment override, its label in `Plan::describe`,
//! its help text (the flag's help and the crate README's row: `readme_rows`) and, for a switch,
//! why it stays. The plan (plan.rs) resolves the options against the adapter and the model into
//! kernels.
//!
//! Environment overrides are read in one function (`WgpuOptions::with_env_overrides`, i.e.
//! `lily_core::options::with_overrides`; `WgpuBackend::new` applies it): a switch's variable set
//! to `1` or `0` sets it (`LILY_WGPU_COOP=0` turns `coop` off), a knob's sets it when it is a
//! number the knob accepts, a text option's when it is a text the option takes
//! (`LILY_WGPU_F16_KV=on`, or `1` as when it was a switch); anything else leaves the option as it
//! is.

use lily_core::options::TextValue;

use crate::gpu::DeviceLimits;

/// Default largest prefill chunk in tokens (activation scratch is sized for it). 4096: a chunk's
/// routed experts average 128 tokens each (256 experts, 8 per token), so each expert's weights
/// serve twice the items of a 2,048-token chunk's tiles (H100 through Vulkan, session 23: prefill
/// 4K 6,759 → 7,076 tok/s, +4.7 %, 512 unchanged; session 7 on the H200: 2,315 tok/s at 512, 3,175
/// at 2048). The scratch is ≈ 186 KB a token in f16 (726 MiB at 4096); its largest binding, the
/// experts' outputs, 151 MB in f16, 302 MB in f32; where that exceeds the device's largest
/// storage binding the plan halves the chunk and says so (`plan::fitting_chunk`).
pub const DEFAULT_PREFILL_CHUNK: usize = 4096;

/// An option the plan decides per adapter unless asked: `auto` (the plan's rule, its reason in
/// the plan line), `on` or `off`. `1` and `0` are taken as `on` and `off` (the variables of the
/// switches these options replaced: `LILY_WGPU_F16_ACTS=1` still turns f16 activations on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Auto,
    On,
    Off,
}

impl Choice {
    /// The resolved side, as the plan's options show it.
    pub fn of(on: bool) -> Choice {
        if on {
            Choice::On
        } else {
            Choice::Off
        }
    }
}

impl TextValue for Choice {
    fn parse_text(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(Choice::Auto),
            "on" | "1" => Some(Choice::On),
            "off" | "0" => Some(Choice::Off),
            _ => None,
        }
    }

    fn show_text(&self) -> String {
        match self {
            Choice::Auto => "auto",
            Choice::On => "on",
            Choice::Off => "off",
        }
        .to_string()
    }
}

/// `adapter` (the adapter's own limits) or `apple` (each capped at an Apple GPU's).
impl TextValue for DeviceLimits {
    fn parse_text(text: &str) -> Option<Self> {
        match text {
            "adapter" => Some(DeviceLimits::Adapter),
            "apple" => Some(DeviceLimits::Apple),
            _ => None,
        }
    }

    fn show_text(&self) -> String {
        match self {
            DeviceLimits::Adapter => "adapter",
            DeviceLimits::Apple => "apple",
        }
        .to_string()
    }
}

lily_core::backend_options! {
    /// How the backend is asked to run (`Default`: the configuration that ships; the
    /// environment's overrides come on top through `with_env_overrides`, which
    /// `WgpuBackend::new` applies). Each option's meaning: its row of `SWITCHES` / `KNOBS` /
    /// `TEXTS` (`help`, `why`).
    pub struct WgpuOptions, heading "wgpu backend", id "wgpu";
    switches {
        attn_tile = true, flag Some("wgpu-no-attend-tile"), env "LILY_WGPU_ATTN_TILE" = true,
            label "attend_tile",
            help "prefill attention on attend_tile.wgsl (K/V read once per tile of tokens) where the model's shapes allow, it fits the device's workgroup memory and its check at load passes, instead of attend_gqa.wgsl (one token a workgroup)",
            why "won its A/B: prefill attention 49.4 → 12.3 µs a token at a 4K prompt on the H200 through Vulkan (session 7); attend_gqa serves the shapes and devices attend_tile does not";
        subgroups = true, flag Some("wgpu-no-subgroups"), env "LILY_WGPU_SUBGROUPS" = true,
            label "subgroup reductions",
            help "the workgroup reductions (norms, softmax, the greedy pick, row totals) on subgroups (reduce_subgroup.wgsl) where the adapter has them, instead of through workgroup memory (reduce_workgroup.wgsl)",
            why "won its A/B on the H200 through Vulkan (session 10: decode +3.4 %, 144.6 against 139.8 tok/s at 4K with workgroup reductions); the workgroup-memory form serves adapters without subgroups";
        f16_tiles = false, flag Some("wgpu-f16-tiles"), env "LILY_WGPU_F16_TILES" = true,
            label "f16 tiles",
            help "prefill's product tiles (linear_q4_mm.wgsl's dequantised weights and staged inputs) in f16 where the adapter has SHADER_F16, sums in f32: dense tiles of 64 items where they fit the device's workgroup memory, each expert's tiles sized by its load; instead of f32 tiles (dense 32, experts 16)",
            why "off: measured on the H200 through Vulkan (session 13: prefill −11 % at 512, +3.8 % at 4K, +2.4 % at 32K; selftest 1.9e-2 on small, past its 1e-3 bound), and cooperative matrices (on) already stage f16 operands where the adapter has them; issue 29 deliverable 5, a Mac's question (Apple GPUs, without NVIDIA's cooperative matrices, may gain where the H200 did not); rounds each product's inputs to f16 (≈ 3e-4 relative a product); on only once it wins its A/B (scripts/wgpu_prefill_ab.sh) and scores at HF bf16's level over 1,024 full-shape positions; the f32 tiles serve adapters without SHADER_F16";
        coop = true, flag Some("wgpu-no-coop"), env "LILY_WGPU_COOP" = true,
            label "cooperative matrices",
            help "prefill's product tiles (linear_q4_mm's launches) on cooperative matrices, linear_q4_coop.wgsl (f16 × f16 → f32 on the adapter's matrix units: 16 × 16 on NVIDIA Vulkan, 8 × 8 on Metal), where the adapter reports wgpu's experimental cooperative-matrix feature with a fitting configuration, SHADER_F16 and subgroups of 32, and its check at load passes; instead of linear_q4_mm.wgsl",
            why "won its A/B on an H100 through Vulkan (session 17: prefill 2,899 / 3,351 → 4,167 / 4,651 tok/s at 512 / 4K, +44 % / +39 %; decode unchanged; its GPU test within 6.5e-7 of the f16-staged product and tiny's logits 9.6e-3 from the CPU over 808 positions, as the f16 tiles' 9.4e-3; selftest agreement 6.8e-4); rounds each product's operands to f16; checked against the host at load, refused where wrong (the reason in the plan line); linear_q4_mm serves adapters without cooperative matrices (lavapipe, CI); never run on a Mac";
        coop_big = true, flag Some("wgpu-no-coop-big"), env "LILY_WGPU_COOP_BIG" = true,
            label "coop big tiles",
            help "with `coop`, prefill's products on linear_q4_coop_big.wgsl instead of linear_q4_coop.wgsl (the same launches: 64 rows × the tile's items a workgroup): steps of 64 columns (half the barriers a multiply-add), every invocation dequantising one 32-column quad a step (not half of them two), the four subgroups as 2 × 2 blocks of 32 rows × half the items where the tile allows (one fragment load a multiply-add instead of 1.25), the accumulators written out in two passes of half the rows (27,920 bytes of workgroup memory at 64 items, as linear_q4_coop's; under Apple's 32 KiB)",
            why "won its A/B on an H200 through Vulkan (session 21, full size, two rounds each: prefill 4,053 / 4,053 → 5,061 / 5,072 tok/s at 512 (+25 %), 4,517 / 4,510 → 5,830 / 5,851 at 4K (+29 %); predicted 5,000–5,900 at 4K; lily-wgpu's coop_products_and_logits_match_cpu passes on that GPU with it, selftest agreement 9.8e-4 with 16/16 greedy tokens); the same values as linear_q4_coop within rounding (emulated: 4.1e-7 from the host product); checked against the host at load with the other products, refused where wrong (then linear_q4_coop is checked, then linear_q4_mm runs); never run on a Mac (8 × 8)";
        attn_flat = true, flag Some("wgpu-no-attn-flat"), env "LILY_WGPU_ATTN_FLAT" = true,
            label "attend_gqa flat reads",
            help "attend_gqa.wgsl's key and value reads with no condition around them, in loops of constant trip count (keys past a split's end read its last key again, weighted 0), so an invocation's reads of a block of keys issue together; outputs bit for bit the same",
            why "won its A/B with attn_split on the H100 through Vulkan (session 15: attend_gqa 84.9 → 38.6 µs a layer at 4K with attend_merge 8.5 → 11.7; the `reads` group 155 → 168 tok/s at 4K, 113 → 144 at 32K; docs/perf-notes.md); outputs bit for bit the same as the conditional reads, which stay for GPUs where it is not measured and its 8 words held an invocation may cost more registers than the reads in flight gain (Apple's)";
        attn_v_early = true, flag Some("wgpu-no-attn-v-early"), env "LILY_WGPU_ATTN_V_EARLY" = true,
            label "attend_gqa early values",
            help "with attn_flat, attend_gqa.wgsl's values of a block's first 32 keys (the whole block where a KV head has 8 query heads: the full model) requested as soon as the block's key products are formed and held in registers through the scores and the softmax (its `VEARLY`), instead of read after the softmax in rounds of 8; outputs bit for bit the same",
            why "won its A/B: decode at 32K 189.3 / 192.9 → 195.3 / 196.0 tok/s (+2.4 %), at 4K 217.5 / 229.9 → 226.8 / 220.8 (even; this card's spread), attend_gqa at 32K 92.3 → 86.3 µs a call (two rounds, an H100 through Vulkan, full size, session 25; predicted +1…+2.4 % at 32K); not yet run on a Mac";
        attn_split = true, flag Some("wgpu-no-attn-split"), env "LILY_WGPU_ATTN_SPLIT" = true,
            label "decode attention split",
            help "decode attention's keys split by the plan for the adapter: spans of whole blocks of attend_gqa's keys (256 / G), up to 256 splits, enough workgroups for the adapter's kind (discrete 512, integrated 128, others 64), instead of ≈ 512 workgroups' worth of 64-key spans and at most 64 splits (on the full model at 4K: 258 workgroups of one block instead of 66 of four)",
            why "won its A/B with attn_flat on the H100 through Vulkan (session 15: decode attention 93 → 50 µs a layer at 4K with the merge; 32K decode 113 → 144 tok/s with the `reads` group; docs/perf-notes.md); off, decode takes prefill's rule (64-key spans, ≤ 64 splits: no code of its own), for GPUs where it is not measured and up to 256 splits' merge may cost more than the extra workgroups gain (Apple's)";
        rows_early = true, flag Some("wgpu-no-rows-early"), env "LILY_WGPU_ROWS_EARLY" = true,
            label "linear_q4_rows early reads",
            help "linear_q4_rows.wgsl (decode's plain products, the MoE's router among them) with every read of a row block's first rows (both 16-byte words of a two-word row, their scales), the input and the folded norm's weights issued before any arithmetic or barrier, the norm's 1 / RMS applied to each row's total",
            why "won its A/B on the H100 through Vulkan (session 15: the router 16.2 → 15.0 µs a call at 4K, the other row products unchanged within 1 %; with glu_early the `moe` group 155 → 162 tok/s at 4K; docs/perf-notes.md); the reads in arithmetic order (the norm's scale before the rows) stay for GPUs where it is not measured and the early reads' held words may cost more registers than they gain (Apple's)";
        glu_early = true, flag Some("wgpu-no-glu-early"), env "LILY_WGPU_GLU_EARLY" = true,
            label "linear_q4_glu_rows early routing",
            help "linear_q4_glu_rows.wgsl (decode's experts' gate/up) routing on order keys with one barrier a round and only the rounds its item needs (rank r after r + 1 rounds, the shared expert after none; row block 0 all k), the folded norm's weights read with the input and its 1 / RMS applied to the gate and up totals",
            why "won its A/B on the H100 through Vulkan (session 15: the experts' gate/up 36.0 → 28.9 µs a call at 4K, 1.44 → 1.16 ms a token; docs/perf-notes.md); the routing in rounds over every rank stays for GPUs where it is not measured (Apple's)";
        rows_persist = true, flag Some("wgpu-no-rows-persist"), env "LILY_WGPU_ROWS_PERSIST" = true,
            label "linear_q4_rows persistent",
            help "linear_q4_rows.wgsl's 16-row kernel (decode's DeltaNet in_proj, attention's q/k/v, lm_head) in rounds of 4 rows, the next round's 16-byte words in flight while it sums the current one; where a matrix has at least twice as many row blocks as the adapter's kind fills workgroups (discrete 512, integrated 128, others 64; `--wgpu-rows-workers` sets the count), on a persistent grid of that many, each streaming its share of the blocks with the input and the folded norm read once (on the full model lm_head; DeltaNet's in_proj and attention's q/k/v keep one workgroup a block); outputs bit for bit the same",
            why "won its A/B on the H100 through Vulkan (session 20, full size, two rounds): decode 178.8 / 178.1 → 195.7 / 195.0 tok/s at 4K (+9.6 %), 158.0 / 158.2 → 173.7 / 172.3 at 32K (+9.4 %), prefill unchanged; in_proj 36.3 → 25.5 µs a call, q/k/v 33.6 → 24.1, lm_head 225 → 195 µs (predicted +1–5 %: the pipelined rounds gained most, not the persistent lm_head); outputs bit for bit; on every adapter as rows_early and glu_early are, Apple's workgroup count (integrated: 128) not measured; the one-workgroup-a-block kernel is the reference";
        moe_rounds = true, flag Some("wgpu-no-moe-rounds"), env "LILY_WGPU_MOE_ROUNDS" = true,
            label "decode MoE rounds",
            help "the decode MoE in rounds of one item: linear_q4_glu_rows.wgsl (the experts' gate/up, routing its own items) on a workgroup a row and token, each item's gate and up words requested as soon as its routing round names its expert (the stacked shared expert's before any) and the previous item summed while they are in flight; moe_down_rows.wgsl (down and the weighted sum) with a slot's next item's input and rows requested before this item's sums (bit for bit the same)",
            why "won its A/B with out_rows 2 on an H200 through Vulkan (session 21, full size, two rounds: decode 194.9 / 199.5 → 209.8 / 213.4 tok/s at 4K, 172.3 / 173.1 → 184.2 / 185.1 at 32K; the experts' glu 26.9 → 25.5 and moe_down 20.3 → 17.1 µs a call; predicted 20–25 / 16–19); its kernel tests pass on that GPU, selftest 16/16 greedy tokens; the kernels reading one round at a time are the reference and serve where it is not measured (Apple's: not run)";
        down_item_lanes = true, flag Some("wgpu-no-down-item-lanes"), env "LILY_WGPU_DOWN_ITEM_LANES" = true,
            label "moe_down one item a lane",
            help "decode's MoE down projections and weighted sum into the residual on moe_down_lanes.wgsl: one item a lane (a workgroup of TOPK × COLS / 32 lanes in whole subgroups: 160 on the full model, not 64), so every item's input, words and scales are requested in one trip after its id (moe_down_rows' slot 0 takes items 0, 4 and 8: two trips in series with moe_rounds) and the residual's element is read at the start rather than after the row totals; the items' terms meet in moe_down_rows' slot and row order: outputs within rounding of moe_down_rows' (bit for bit on lavapipe; not on NVIDIA's Vulkan driver, which orders or contracts the multiply-adds otherwise)",
            why "won its A/B on an H100 through Vulkan (session 31, full size, two rounds: decode 253.0 / 252.9 → 260.9 / 262.7 tok/s at 4K (+3.5 %), 217.0 / 217.4 → 221.0 / 223.6 at 32K (+2.2 %)); its kernel test there matched the host (2.3e-7) but not moe_down_rows' bits (the test now takes a tolerance); off, moe_down_rows with moe_rounds, which served from session 21 to 30, is the reference and serves where it is not measured (Apple's: not run)";
        rows_one_word = true, flag Some("wgpu-no-rows-one-word"), env "LILY_WGPU_ROWS_ONE_WORD" = true,
            label "linear_q4_rows one-word 16-row kernel",
            help "linear_q4_rows.wgsl's 16-row kernel (decode's DeltaNet in_proj, attention's q/k/v, lm_head) compiled for rows of one 16-byte word a lane (4-bit, 2,048 columns: its `WORDS` 1), so that the second words' inputs and, with rows_persist, the two rounds' second words carried between rounds (their registers) are compiled out; a two-word matrix of ≥ 8,192 rows (none on the full model) takes the 8-row kernel in rounds instead; outputs bit for bit the same",
            why "won its A/B on an H100 through Vulkan (session 24, full size, two rounds: decode 205.3 / 207.0 → 228.7 / 223.5 tok/s at 4K (+9.6 %), 178.8 / 180.8 → 194.0 / 193.8 at 32K (+7.9 %); in_proj 34.1 → 24.8 and q/k/v 31.0 → 23.1 µs a call; predicted +7…+11 % / +6…+9 %): since session 21 the persistent kernel carried the second words between rounds for every matrix, a run-time choice; its GPU test passes bit for bit against the kernel of one or two words a row chosen at run time, which serves every matrix with the switch off and is the reference (Apple's: not run)";
        router_lean = true, flag Some("wgpu-no-router-lean"), env "LILY_WGPU_ROUTER_LEAN" = true,
            label "linear_q4_rows lean 1-row router",
            help "the products of fewer than 1,024 rows (decode's MoE router with the shared expert's gate on the full model: 257 rows, 8-bit) on linear_q4_rows.wgsl with one row a workgroup (257 workgroups reading 2 16-byte words a lane, not 129 reading 4) and the row's 64 partials summed with the folded norm's Σx² in one two-value workgroup sum (its `LEAN`: one subgroupAdd and one barrier where the norm's scale and `row_total` take five barriers and 32 serial adds); outputs within rounding of the 2-row kernel (the partials meet in another order)",
            why "won its A/B on an H100 through Vulkan (session 26, full size, two rounds: decode 226.5 / 229.3 → 236.9 / 237.7 tok/s at 4K (+4.0 %), 196.6 → 205.1 / 203.7 at 32K (+3.9 %); predicted +1.3…+2.2 % / +1.1…+1.9 %); its GPU test passes against the host's f64; off, the 2-row kernel, which the 2,048-row output projections share, is the reference and serves where it is not measured (Apple's: not run)";
        dn_one_sync = true, flag Some("wgpu-no-dn-one-sync"), env "LILY_WGPU_DN_ONE_SYNC" = true,
            label "decode DeltaNet step one exchange",
            help "dn_recur_norm.wgsl (decode's DeltaNet recurrence and gated norm, a workgroup of 512 a value head) with one exchange of the four slices' partials instead of two (o = α S₀ᵀq̂ + δ (k̂ᵀq̂), so the state's update and stores leave the chain to the output), v, z and the norm's weight read with the state, the head's Σ o² in 16 partials (its `ONE_SYNC`: 3 barriers, not 10; one memory trip, not three); the state bit for bit the same, the output within rounding",
            why "won its A/B on an H100 through Vulkan (session 28, full size, decode at 4K / 32K: in a quiet call off 244.2 / 210.7 and 244.4 / 210.5 → on 253.0 / 216.9 (+3.5 % / +3.0 %; predicted +1…+1.7 %); an earlier, noisier call of the same session, two rounds: 238.1 / — and 223.2 / 202.2 → 233.2 / 203.3 and 244.8 / 198.0); its GPU tests pass there (the state bit for bit the old kernel's in 12 cases, 24 greedy tokens the same as the CPU in both reduction forms); off, the kernel that served from session 12 to 27 (Apple's: not run)";
        checked = false, flag None, env "LILY_WGPU_CHECKED" = true,
            label "bounds checks",
            help "debug: wgpu's runtime bounds checks kept in the shaders",
            why "a debugging aid";
        profile = false, flag None, env "LILY_WGPU_PROFILE" | "LILY_PROFILE" = true,
            label "profiling",
            help "per-kernel GPU times (timestamp queries where the adapter has them), printed at the end of `lily-engine bench`",
            why "a measuring aid";
    }
    knobs {
        chunk = DEFAULT_PREFILL_CHUNK, flag Some("wgpu-prefill-chunk"), env "LILY_WGPU_CHUNK",
            accepts |n| n > 0, "at least 1", label "prefill chunk",
            help "largest prefill chunk in tokens (activation scratch is sized for it); halved where a chunk's largest activation would exceed the device's largest storage binding, as the plan line says";
        dense_tile = 0, flag Some("wgpu-dense-tile"), env "LILY_WGPU_DENSE_TILE",
            accepts |n| matches!(n, 0 | 16 | 32 | 64), "0, 16, 32 or 64", label "dense tile",
            help "items per tile of prefill's dense products (linear_q4_mm.wgsl): 0 lets the plan choose (32 with f32 tiles, 64 with f16 tiles where they fit the device's workgroup memory); an A/B aid (tiles of 64 in f32 against f16's)";
        coop_rows = 128, flag Some("wgpu-coop-rows"), env "LILY_WGPU_COOP_ROWS",
            accepts |n| matches!(n, 64 | 128), "64 or 128", label "coop rows",
            help "with `coop_big`, linear_q4_coop_big.wgsl's rows a workgroup for prefill's dense products: 128 (the default: 256 invocations, eight subgroups: each staged input tile feeds twice the rows, staged elements a multiply-add 128 → 96 at tiles of 64 items; 45,328 bytes of workgroup memory at 64 items on 16 × 16, so only where the adapter allows that, NVIDIA's 48 KiB, else the plan keeps 64 and says so: not Apple's 32 KiB) or 64 (128 invocations, as linear_q4_coop's launches: every product as before session 22's split); the routed experts' grouped products keep 64 rows either way (`Plan::expert_rows`); checked at load as the other products, refused where wrong (then 64 rows for all are checked); session 22 on an H100 through Vulkan, 128 rows for every product: prefill 4K 6,040 → 6,420 tok/s but 512 5,130 → 4,646; at 4K DeltaNet in_proj 1,938 → 1,231 µs a call, dn.out 841 → 529, attention qkv 1,560 → 946, while the routed experts' gate / up / down went 367 / 368 / 400 → 428 / 428 / 452 (few items a tile): so the dense products take 128 rows, the experts 64; that split measured in session 23 (an H100 through Vulkan, two rounds against 64 for all): prefill 4K 6,041 / 6,044 → 6,837 / 6,837 tok/s (+13.2 %), 512 5,162 / 5,166 → 5,660 / 4,830 (unsteady), decode unchanged; an A/B aid";
        rows_workers = 0, flag Some("wgpu-rows-workers"), env "LILY_WGPU_ROWS_WORKERS",
            accepts |n| n <= 65_535, "0 to 65,535", label "rows workers",
            help "with rows_persist, the workgroups of a persistent linear_q4_rows launch: 0 lets the plan choose by the adapter's kind (discrete 512, integrated 128, others 64); an A/B aid (the count that fills a given GPU)";
        out_rows = 2, flag Some("wgpu-out-rows"), env "LILY_WGPU_OUT_ROWS",
            accepts |n| matches!(n, 0 | 2 | 4 | 8 | 16), "0, 2, 4, 8 or 16", label "out rows",
            help "linear_q4_rows.wgsl's rows a workgroup for the matrices of 1,024 to 8,191 rows (decode's DeltaNet out_proj and attention's o on the full model): 2 (the default: 1,024 workgroups of one round; session 21 on an H200 through Vulkan: out_proj 20.2 → 15.9 µs a call, attention's o 20.6 → 16.4); 0 the other matrices' rule (4: 512 workgroups of one round); 8: two rounds of 4 rows, the second's words (both of a 4,096-column row) requested before the first's sums (256 workgroups); 16: the 16-row kernel as compiled (with rows_persist four such rounds, 128 workgroups); 2: 1,024 workgroups of one round; an A/B aid (session 21: out_proj's rounds)";
        glu_rows = 0, flag Some("wgpu-glu-rows"), env "LILY_WGPU_GLU_ROWS",
            accepts |n| matches!(n, 0 | 4 | 8 | 16), "0, 4, 8 or 16", label "glu rows",
            help "linear_q4_glu_rows.wgsl's rows a workgroup (decode's experts' gate/up, where not in moe_rounds' items form): 0 lets the plan choose (8: 576 workgroups on the full model); 4: 1,152 workgroups of 4 rows; an A/B aid (session 21: fewer words a lane)";
        down_rows = 2, flag Some("wgpu-down-rows"), env "LILY_WGPU_DOWN_ROWS",
            accepts |n| matches!(n, 0 | 2 | 4 | 8), "0, 2, 4 or 8", label "down rows",
            help "moe_down_rows.wgsl's rows a workgroup (decode's experts' down and weighted sum): 2 (the default: 1,024 workgroups of 2 rows on the full model; session 21 on an H100 through Vulkan with moe_rounds: decode 198.9 / 200.2 → 203.1 / 206.5 tok/s at 4K, 175.4 / 174.7 → 178.6 / 177.0 at 32K; moe_down 20.3 → 14.4 µs a call without moe_rounds on an H200); 0 the plan's old rule (4: 512 workgroups); 8: 256 workgroups; an A/B aid";
    }
    texts {
        f16_kv: Choice = Choice::Auto, flag Some("wgpu-f16-kv"), env "LILY_WGPU_F16_KV",
            value "WHEN", alone "on", accepts "auto, on or off, or 1 / 0", label "f16 KV cache",
            help "the KV cache in f16 (scores, softmax and sums in f32) instead of f32, where the adapter has SHADER_F16: auto lets the plan decide by the adapter's kind (`plan::f16_rule`: on for Apple GPUs through Metal and for NVIDIA's, measured with coop on an H100; off on other adapters until measured; the plan line says which and why), on and off force it";
        f16_acts: Choice = Choice::Auto, flag Some("wgpu-f16-acts"), env "LILY_WGPU_F16_ACTS",
            value "WHEN", alone "on", accepts "auto, on or off, or 1 / 0", label "f16 activations",
            help "the activations between kernels (normed inputs, the products' outputs, attention's and DeltaNet's intermediates, the GLU's, the experts' outputs) in f16 instead of f32, where the adapter has SHADER_F16; the residual stream, logits, router logits, recurrent and conv state and every sum stay f32: auto lets the plan decide by the adapter's kind (`plan::f16_rule`: on for Apple GPUs through Metal and for NVIDIA's, measured with coop on an H100; off on other adapters until measured; the plan line says which and why), on and off force it";
        limits: DeviceLimits = DeviceLimits::Adapter, flag Some("wgpu-limits"), env "LILY_WGPU_LIMITS",
            value "LIMITS", accepts "adapter or apple", label "limits",
            help "the limits the device is created with: the adapter's own, or each capped at an Apple GPU's through Metal (32 KiB of workgroup memory; the contract CI checks without a Mac)";
        adapter: Option<String> = None, flag Some("wgpu-adapter"), env "LILY_WGPU_ADAPTER",
            value "NAME", accepts "part of an adapter's name", label "adapter",
            help "the adapter whose name contains this, else the best one (discrete, integrated, virtual, then software)";
    }
    fields {
        /// Most positions whose logits one pass keeps (`prefill_all_logits`).
        all_logits_chunk: usize = 32;
        /// Whether a software adapter (lavapipe) may be used (`--device auto` says no).
        allow_software: bool = true;
        /// Resolve the `auto` choices (`f16_acts`, `f16_kv`) as for an Apple GPU through Metal on
        /// any adapter (tests/apple_limits.rs: the configuration a Mac gets, on lavapipe in CI).
        auto_as_apple: bool = false;
        /// Cut weights into slices of at most this many bytes even where the device binds more
        /// (tests: exercises the sliced path on a tiny model).
        max_slice_bytes: Option<u64> = None;
    }
}

/// The crate README's table of options (README.md holds exactly these rows; a unit test checks
/// it).
pub fn readme_rows() -> String {
    lily_core::options::readme_rows::<WgpuOptions>()
}

#[cfg(test)]
mod tests {
    use super::*;

    use lily_core::options::env_of as env;

    #[test]
    fn the_defaults_are_the_configuration_that_ships() {
        // Written out field by field (not from the table) so the test checks the table.
        assert_eq!(
            WgpuOptions::default(),
            WgpuOptions {
                chunk: 4096,
                all_logits_chunk: 32,
                allow_software: true,
                checked: false,
                max_slice_bytes: None,
                attn_tile: true,
                adapter: None,
                profile: false,
                limits: DeviceLimits::Adapter,
                subgroups: true,
                f16_kv: Choice::Auto,
                f16_tiles: false,
                f16_acts: Choice::Auto,
                auto_as_apple: false,
                coop: true,
                coop_big: true,
                attn_flat: true,
                attn_v_early: true,
                attn_split: true,
                rows_early: true,
                glu_early: true,
                rows_persist: true,
                moe_rounds: true,
                down_item_lanes: true,
                rows_one_word: true,
                router_lean: true,
                dn_one_sync: true,
                dense_tile: 0,
                coop_rows: 128,
                rows_workers: 0,
                out_rows: 2,
                glu_rows: 0,
                down_rows: 2,
            }
        );
    }

    #[test]
    fn no_environment_leaves_the_options_as_given() {
        let o = WgpuOptions {
            chunk: 96,
            subgroups: false,
            adapter: Some("llvmpipe".into()),
            ..WgpuOptions::default()
        };
        assert_eq!(o.clone().with_overrides(env(&[])), o);
    }

    #[test]
    fn environment_variables_override_the_options() {
        let o = WgpuOptions::default().with_overrides(env(&[
            ("LILY_WGPU_CHUNK", "512"),
            ("LILY_WGPU_CHECKED", "1"),
            ("LILY_WGPU_ATTN_TILE", "0"),
            ("LILY_WGPU_ADAPTER", "H200"),
            ("LILY_PROFILE", "1"),
            ("LILY_WGPU_LIMITS", "apple"),
            ("LILY_WGPU_SUBGROUPS", "0"),
            ("LILY_WGPU_F16_KV", "1"),
            ("LILY_WGPU_F16_TILES", "1"),
            ("LILY_WGPU_F16_ACTS", "off"),
            ("LILY_WGPU_COOP", "0"),
            ("LILY_WGPU_COOP_BIG", "0"),
            ("LILY_WGPU_DENSE_TILE", "64"),
            ("LILY_WGPU_COOP_ROWS", "64"),
            ("LILY_WGPU_ATTN_FLAT", "0"),
            ("LILY_WGPU_ATTN_V_EARLY", "0"),
            ("LILY_WGPU_ATTN_SPLIT", "0"),
            ("LILY_WGPU_ROWS_EARLY", "0"),
            ("LILY_WGPU_GLU_EARLY", "0"),
            ("LILY_WGPU_ROWS_PERSIST", "1"),
            ("LILY_WGPU_MOE_ROUNDS", "0"),
            ("LILY_WGPU_ROWS_ONE_WORD", "0"),
            ("LILY_WGPU_DOWN_ITEM_LANES", "0"),
            ("LILY_WGPU_ROUTER_LEAN", "0"),
            ("LILY_WGPU_DN_ONE_SYNC", "0"),
            ("LILY_WGPU_ROWS_WORKERS", "264"),
            ("LILY_WGPU_OUT_ROWS", "8"),
            ("LILY_WGPU_GLU_ROWS", "4"),
            ("LILY_WGPU_DOWN_ROWS", "8"),
        ]));
        assert_eq!(
            o,
            WgpuOptions {
                chunk: 512,
                checked: true,
                attn_tile: false,
                adapter: Some("H200".into()),
                profile: true,
                limits: DeviceLimits::Apple,
                subgroups: false,
                f16_kv: Choice::On,
                f16_tiles: true,
                f16_acts: Choice::Off,
                coop: false,
                coop_big: false,
                dense_tile: 64,
                coop_rows: 64,
                attn_flat: false,
                attn_v_early: false,
                attn_split: false,
                rows_early: false,
                glu_early: false,
                rows_persist: true,
                moe_rounds: false,
                down_item_lanes: false,
                rows_one_word: false,
                router_lean: false,
                dn_one_sync: false,
                rows_workers: 264,
                out_rows: 8,
                glu_rows: 4,
                down_rows: 8,
                ..WgpuOptions::default()
            }
        );
        // Either profiling variable; the backend's own is read first.
        let o = WgpuOptions::default().with_overrides(env(&[("LILY_WGPU_PROFILE", "1")]));
        assert!(o.profile);
        let o = WgpuOptions::default()
            .with_overrides(env(&[("LILY_WGPU_PROFILE", "0"), ("LILY_PROFILE", "1")]));
        assert!(!o.profile);
        // The f16 choices take the texts and a switch's 1 / 0 (the variables they had as
        // switches).
        for (text, choice) in [
            ("auto", Choice::Auto),
            ("on", Choice::On),
            ("1", Choice::On),
            ("off", Choice::Off),
            ("0", Choice::Off),
        ] {
            let asked = WgpuOptions {
                f16_acts: Choice::Off,
                f16_kv: Choice::On,
                ..WgpuOptions::default()
            };
            let o = asked.with_overrides(env(&[
                ("LILY_WGPU_F16_ACTS", text),
                ("LILY_WGPU_F16_KV", text),
            ]));
            assert_eq!((o.f16_acts, o.f16_kv), (choice, choice), "{text}");
        }
        // Values that are not the documented ones change nothing.
        let o = WgpuOptions::default().with_overrides(env(&[
            ("LILY_WGPU_CHUNK", "0"),
            ("LILY_WGPU_ATTN_TILE", "yes"),
            ("LILY_WGPU_LIMITS", "metal"),
            ("LILY_WGPU_DENSE_TILE", "48"),
            ("LILY_WGPU_COOP_ROWS", "96"),
            ("LILY_WGPU_F16_ACTS", "yes"),
        ]));
        assert_eq!(o, WgpuOptions::default());
        // The environment sets the side a flag's options did not.
        let asked = WgpuOptions {
            limits: DeviceLimits::Apple,
            ..WgpuOptions::default()
        };
        let o = asked.with_overrides(env(&[("LILY_WGPU_LIMITS", "adapter")]));
        assert_eq!(o.limits, DeviceLimits::Adapter);
    }

    #[test]
    fn every_row_names_a_field_and_flags_and_variables_are_unique() {
        let names = lily_core::options::check_table::<WgpuOptions>();
        // Every flag is the backend's own.
        assert!(names
            .iter()
            .filter(|n| !n.starts_with("LILY_"))
            .all(|f| f.starts_with("wgpu-")));
    }

    #[test]
    fn describe_names_every_option() {
        let d = WgpuOptions {
            f16_kv: Choice::Off,
            chunk: 512,
            limits: DeviceLimits::Apple,
            ..WgpuOptions::default()
        }
        .describe();
        assert!(
            d.starts_with("attend_tile on, subgroup reductions on, f16 tiles off,"),
            "{d}"
        );
        assert!(
            d.contains("prefill chunk 512")
                && d.ends_with("f16 KV cache off, f16 activations auto, limits apple, adapter any"),
            "{d}"
        );
        assert_eq!(
            d.split(", ").count(),
            SWITCHES.len() + KNOBS.len() + TEXTS.len()
        );
    }

    #[test]
    fn the_readme_lists_every_option_as_the_table_says() {
        let readme = include_str!("../README.md");
        let rows = readme_rows();
        assert!(
            readme.contains(&rows),
            "crates/lily-wgpu/README.md's option table differs from options::readme_rows():\n{rows}"
        );
    }
}
