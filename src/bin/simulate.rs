//! The simulator's soak runner: `simulate [--steps N] [--seed S] [--rounds R] [--faults LIST]
//! [--replay ROUND_SEED]`. Runs rounds of the deterministic simulation (see `vouchers::sim`)
//! until the step budget is spent; prints a failure with its trimmed trace and the command that
//! replays it, and as its last line `N steps, N invariant checks, N violations, N steps/s`.
//! Exits 1 on a violation, 2 on bad arguments.

#![allow(
    clippy::print_stdout,
    reason = "a command-line tool: its output is its answer"
)]

use std::process::ExitCode;

use vouchers::sim::{run, Faults, Options};

fn parse() -> Result<Options, String> {
    let mut opts = Options {
        steps: 1_000_000,
        ..Options::default()
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--steps" => opts.steps = number()?,
            "--seed" => opts.seed = number()?,
            "--rounds" => opts.rounds = number()?,
            "--replay" => opts.replay = Some(number()?),
            "--faults" => opts.faults = Faults::parse(&value)?,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(opts)
}

fn main() -> ExitCode {
    let opts = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("simulate: {e}");
            eprintln!(
                "usage: simulate [--steps N] [--seed S] [--rounds R] [--faults all|none|crash,pause,…] [--replay ROUND_SEED]"
            );
            return ExitCode::from(2);
        }
    };
    let report = run(&opts);
    println!(
        "seed {}: {} rounds, {} reserves, {} faults injected, sold {} of {} units offered",
        opts.seed,
        report.rounds,
        report.reserves,
        report.faults_injected,
        report.sold,
        report.offered
    );
    for v in &report.violations {
        println!(
            "VIOLATION (round seed {}, faults {}, step {}, {} ms into the round):",
            v.round_seed,
            v.faults.names(),
            v.step,
            v.at_ms - 1_000_000
        );
        println!("  {}", v.what);
        println!(
            "trace (trimmed to {}):",
            v.code.as_deref().unwrap_or("every voucher")
        );
        for line in &v.trace {
            println!("  {line}");
        }
        println!("replay: {}", v.replay_command());
    }
    println!("{}", report.last_line());
    if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
