//! `lily-engine selftest` on wgpu's two configurations, run as a user runs it: a synthetic `tiny`
//! model, the software adapter allowed (lavapipe in CI; without a Vulkan driver the test skips,
//! except under CI=true). The fp32 configuration is checked against the CPU at 1e-3; the
//! shipping one, with f16 activations and KV cache asked for as a Mac gets them by default
//! (`--wgpu-f16-acts on --wgpu-f16-kv on`: lavapipe has SHADER_F16), at f16's bound, its greedy
//! tokens reported and its one-token steps checked on the CPU's tokens; a failing f16 check
//! fails the run and names the flags that serve in fp32.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn engine() -> &'static str {
    env!("CARGO_BIN_EXE_lily-engine")
}

fn ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

/// A `tiny` model in a fresh directory.
fn tiny(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lily-selftest-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(engine())
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

fn selftest(model: &Path, args: &[&str]) -> Output {
    Command::new(engine())
        .arg("selftest")
        .arg("--model")
        .arg(model)
        .args([
            "--allow-software",
            "--steps",
            "8",
            "--bench-prefill",
            "16",
            "--bench-decode",
            "4",
        ])
        .args(args)
        .env_remove("LILY_SELFTEST_FAULT")
        .env_remove("LILY_WGPU_F16_ACTS")
        .env_remove("LILY_WGPU_F16_KV")
        .env_remove("LILY_WGPU_COOP")
        .output()
        .unwrap()
}

/// The report's block for device wgpu, or `None` (skipped, with a message) where it was not
/// tested; under CI=true a missing wgpu fails.
fn wgpu_block(stdout: &str) -> Option<String> {
    let Some(at) = stdout.find("device: wgpu\n") else {
        assert!(!ci(), "CI needs wgpu on lavapipe:\n{stdout}");
        println!("SKIPPED: wgpu not tested here:\n{stdout}");
        return None;
    };
    let block: Vec<&str> = stdout[at..]
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect();
    Some(block.join("\n"))
}

/// The number after `key` in `line`.
fn number_after(line: &str, key: &str) -> f64 {
    let at = line
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {line}"))
        + key.len();
    let text: String = line[at..]
        .trim_start()
        .chars()
        .take_while(|c| !matches!(c, ';' | ' ' | ')'))
        .collect();
    text.parse()
        .unwrap_or_else(|_| panic!("{text:?} in {line}"))
}

#[test]
fn both_configurations_are_checked_and_reported() {
    let model = tiny("both");
    let out = selftest(&model, &["--wgpu-f16-acts", "on", "--wgpu-f16-kv"]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let _ = std::fs::remove_dir_all(&model);
    let Some(wgpu) = wgpu_block(&stdout) else {
        return;
    };
    println!("{wgpu}");
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout
            .contains("<= 1e-3 in fp32; <= 1e-1 where wgpu's shipping configuration rounds to f16"),
        "{stdout}"
    );
    let lines: Vec<&str> = wgpu.lines().collect();
    // The fp32 check: the kernels at 1e-3, greedy tokens identical.
    let fp32 = lines
        .iter()
        .find(|l| l.contains("agreement (fp32 configuration, bound 1e-3):"))
        .unwrap_or_else(|| panic!("no fp32 check in\n{wgpu}"));
    assert!(number_after(fp32, "logits rel. L2") <= 1e-3, "{fp32}");
    assert!(fp32.ends_with("greedy tokens 8/8 identical: ok"), "{fp32}");
    // The shipping configuration as asked: its plan line, then its check at f16's bound.
    assert!(
        lines.iter().any(
            |l| l.starts_with("  backend (shipping configuration): wgpu")
                && l.contains("f16 activations,")
        ),
        "{wgpu}"
    );
    let f16 = lines
        .iter()
        .find(|l| {
            l.contains(
                "agreement (shipping configuration: f16 activations, f16 KV cache, bound 1e-1):",
            )
        })
        .unwrap_or_else(|| panic!("no f16 check in\n{wgpu}"));
    let (logits, steps) = (
        number_after(f16, "logits rel. L2"),
        number_after(f16, "one-token steps on the CPU's tokens rel. L2"),
    );
    // f16's rounding shows (fp32's 4e-6 would mean f16 was not in use), within its bound.
    assert!(logits > 1e-4 && logits <= 1e-1, "{f16}");
    assert!(steps > 1e-4 && steps <= 1e-1, "{f16}");
    assert!(f16.ends_with(": ok"), "{f16}");
    assert!(
        stdout.contains("PASS: every device tested agrees with the CPU"),
        "{stdout}"
    );
}

#[test]
fn a_failing_f16_check_fails_the_run_and_names_the_fp32_flags() {
    let model = tiny("fail");
    // A bound f16 cannot meet: the fp32 check passes, the f16 one fails the run.
    let out = selftest(
        &model,
        &[
            "--wgpu-f16-acts",
            "on",
            "--wgpu-f16-kv",
            "on",
            "--f16-tolerance",
            "1e-6",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let _ = std::fs::remove_dir_all(&model);
    let Some(wgpu) = wgpu_block(&stdout) else {
        return;
    };
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        wgpu.contains("agreement (fp32 configuration, bound 1e-3):"),
        "{wgpu}"
    );
    assert!(
        wgpu.lines()
            .any(|l| l.contains("bound 1e-6):") && l.ends_with("DISAGREES with the CPU")),
        "{wgpu}"
    );
    assert!(
        wgpu.contains("run with --wgpu-f16-acts off --wgpu-f16-kv off"),
        "{wgpu}"
    );
    assert!(stdout.contains("FAIL: wgpu"), "{stdout}");
}

#[test]
fn without_f16_the_shipping_configuration_is_the_fp32_one_and_says_why() {
    let model = tiny("auto");
    // The defaults: on lavapipe (neither an Apple nor an NVIDIA GPU) the plan leaves f16 off and
    // says why.
    let out = selftest(&model, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let _ = std::fs::remove_dir_all(&model);
    let Some(wgpu) = wgpu_block(&stdout) else {
        return;
    };
    assert!(out.status.success(), "{stdout}");
    assert!(
        wgpu.contains("shipping configuration: the fp32 one (f16 activations: off (not yet measured on this adapter kind); f16 KV cache: off (not yet measured on this adapter kind))"),
        "{wgpu}"
    );
    assert!(!wgpu.contains("backend (shipping configuration)"), "{wgpu}");
}
