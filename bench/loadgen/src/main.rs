//! fastbroker-loadgen: MQTT load generator for the broker benchmarks. See `cli::USAGE`.

mod cli;
mod conns;
mod hist;
mod json;
mod mqtt;
mod net;
mod persist;
mod run;
mod scan;
mod stream;

use std::io::Write;
use std::process::ExitCode;

use cli::Scenario;
use json::Obj;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match cli::parse(&args) {
        Ok(o) => o,
        Err(e) if e == "help" => {
            println!("{}", cli::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("fastbroker-loadgen: {e}\n{}", cli::USAGE);
            return ExitCode::from(2);
        }
    };
    if let Err(e) = stream::configure(&opts) {
        eprintln!("fastbroker-loadgen: {e}");
        return ExitCode::from(2);
    }
    net::raise_nofile_limit();
    let name = opts.scenario.name();
    let outcome = match opts.scenario {
        Scenario::Connections => conns::run(&opts).map(|o| (o.result, o.errors)),
        Scenario::Loopback => run::run_loopback(&opts).map(|r| (r, 0)),
        Scenario::Fill => persist::run_fill(&opts).map(|r| (r, 0)),
        Scenario::Drain => persist::run_drain(&opts).map(|r| (r, 0)),
        _ => run::run_messages(&opts).map(|r| (r, 0)),
    };
    let mut out = std::io::stdout().lock();
    match outcome {
        Ok((result, errors)) => {
            let _ = writeln!(out, "{result}");
            let _ = out.flush();
            if errors > 0 {
                eprintln!(
                    "fastbroker-loadgen: {name}: {errors} connection(s) failed or were closed"
                );
                ExitCode::from(3)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("fastbroker-loadgen: {name}: FAILED: {e}");
            let mut r = Obj::new();
            r.set("scenario", name).set("error", e);
            let _ = writeln!(out, "{r}");
            let _ = out.flush();
            ExitCode::from(1)
        }
    }
}
