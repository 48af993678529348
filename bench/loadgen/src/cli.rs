//! Command line: `fastbroker-loadgen <scenario> [--option value | --option=value]...`.

use std::net::Ipv4Addr;

use fastbroker_core::codec::Protocol;

use crate::net;

pub const USAGE: &str = "\
usage: fastbroker-loadgen <scenario> --host 127.0.0.1 --port P [--duration SECS=5] [--warmup SECS=1]
                          [--protocol 4|5] [options]
scenarios (defaults shown):
  fan-in      --publishers 8 --payload 64 --qos 0    publishers on bench/in/NN -> 1 subscriber on bench/in/+
  fan-out     --subscribers 50 --payload 64 --qos 0  1 publisher -> N subscribers of bench/out
  pairs       --pairs 50 --payload 64 --qos 0        N publisher/subscriber pairs on bench/pair/NN
  qos1        --publishers 8 --inflight 64 --payload 64
                                                     QoS 1 publishers (up to INFLIGHT unacked each)
                                                     -> 1 QoS 1 subscriber that PUBACKs every message
  latency     --rate 5000 --payload 64               1 paced publisher (send time in the payload)
                                                     -> 1 subscriber; latency percentiles in us
  connections --count 15000 --sources 127.0.0.2-127.0.0.16 --hold 10 --concurrency 256
                                                     open COUNT MQTT connections, print {\"ready\": true, ...},
                                                     hold them HOLD s, close, print the result
  throughput  --payload 1024 --publishers 1          MB/s of payload, publishers -> 1 subscriber on bench/tp
  loopback    --payload 65536                        no broker: TCP loopback copy ceiling in MB/s
  fill        --count 1000000 --publishers 8 --inflight 64 --payload 64 --persistent-subscriber ID
                                                     not timed: the persistent subscriber ID subscribes to
                                                     bench/in/+ at QoS 1 and disconnects, then the publishers
                                                     send COUNT QoS 1 messages on bench/in/NN, all acked
  drain       --count 1000000 --persistent-subscriber ID
                                                     the persistent subscriber ID reconnects (no SUBSCRIBE)
                                                     and PUBACKs until COUNT messages arrived; time to them
other options:
  --rate R             fan-in/fan-out/pairs/throughput: cap all publishers together at R msg/s
                       (default 0 = as fast as TCP flow control lets them)
  --inflight N         QoS 1 window per publisher (fan-in/fan-out/pairs/throughput with --qos 1)
  --batch BYTES        bytes per write for flooding publishers (default 65536)
  --rcvlowat BYTES     SO_RCVLOWAT of QoS 0 subscribers outside latency (default 32768, 0 = off):
                       fewer wake-ups and reads when the broker writes message by message
  --persistent-subscriber ID
                       qos1/fan-in/throughput/latency, fill, drain: the subscriber keeps its session:
                       client id ID, clean session 0 (3.1.1) / clean start 0 and session expiry
                       0xFFFFFFFF (5.0); without it every session is clean, client ids fbl-PID-*
  --time-limit S       fill/drain: fail if not done after S (default 120)
  --topic-prefix P     first topic level (default bench)
  --connect-timeout S  per connection set-up (default 10)
  --connect-phase-timeout S   connections: stop opening new connections after S (default 120)
  --username U / --password P  credentials in every CONNECT (default none)
  --tls-ca FILE        MQTT over TLS (rustls), trusting the CA certificates in FILE (PEM); the
                       server name checked is --tls-server-name or --host (an IP address works
                       if the certificate has it as a subjectAltName); not for connections
  --ws-path PATH       MQTT over WebSocket (subprotocol mqtt) at PATH, e.g. /mqtt; with --tls-ca:
                       secure WebSocket; not for connections
  --sub-addrs H:P,...  fan-in/fan-out/pairs/qos1/latency/throughput: subscriber i connects to
  --pub-addrs H:P,...  the (i mod N)th address, publishers likewise (default --host:--port):
                       clients spread over the nodes of a cluster, or two bridged brokers
One JSON object is printed on stdout at the end; progress and errors go to stderr.
Exit status: 0 ok, 1 run failed (refused, connection broken...), 2 usage, 3 connections with errors.";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    FanIn,
    FanOut,
    Pairs,
    Qos1,
    Latency,
    Connections,
    Throughput,
    Loopback,
    Fill,
    Drain,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::FanIn => "fan-in",
            Scenario::FanOut => "fan-out",
            Scenario::Pairs => "pairs",
            Scenario::Qos1 => "qos1",
            Scenario::Latency => "latency",
            Scenario::Connections => "connections",
            Scenario::Throughput => "throughput",
            Scenario::Loopback => "loopback",
            Scenario::Fill => "fill",
            Scenario::Drain => "drain",
        }
    }

    fn parse(s: &str) -> Option<Scenario> {
        Some(match s {
            "fan-in" | "fanin" => Scenario::FanIn,
            "fan-out" | "fanout" => Scenario::FanOut,
            "pairs" => Scenario::Pairs,
            "qos1" => Scenario::Qos1,
            "latency" => Scenario::Latency,
            "connections" => Scenario::Connections,
            "throughput" => Scenario::Throughput,
            "loopback" => Scenario::Loopback,
            "fill" => Scenario::Fill,
            "drain" => Scenario::Drain,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug)]
pub struct Opts {
    pub scenario: Scenario,
    pub host: String,
    pub port: u16,
    pub duration: f64,
    pub warmup: f64,
    pub protocol: Protocol,
    pub payload: usize,
    pub qos: u8,
    pub publishers: usize,
    pub subscribers: usize,
    pub pairs: usize,
    pub inflight: usize,
    pub rate: f64,
    pub count: usize,
    pub sources: Vec<Ipv4Addr>,
    pub sources_spec: String,
    pub hold: f64,
    pub concurrency: usize,
    pub batch: usize,
    pub rcvlowat: usize,
    pub topic_prefix: String,
    pub connect_timeout: f64,
    pub connect_phase_timeout: f64,
    /// Client id of a subscriber that keeps its session (None: clean sessions).
    pub persistent_subscriber: Option<String>,
    pub time_limit: f64,
    pub username: Option<String>,
    pub password: Option<String>,
    /// PEM file of the CA certificates to trust: TLS on.
    pub tls_ca: Option<String>,
    pub tls_server_name: Option<String>,
    /// WebSocket request path: WebSocket on.
    pub ws_path: Option<String>,
    /// Brokers (HOST:PORT) the subscribers and the publishers connect to, round robin by
    /// client number; empty: --host and --port. For brokers of one cluster, or bridged.
    pub sub_addrs: Vec<String>,
    pub pub_addrs: Vec<String>,
}

impl Opts {
    fn defaults(scenario: Scenario) -> Opts {
        Opts {
            scenario,
            host: "127.0.0.1".into(),
            port: 1883,
            duration: 5.0,
            warmup: 1.0,
            protocol: Protocol::V311,
            payload: if scenario == Scenario::Loopback {
                65536
            } else if scenario == Scenario::Throughput {
                1024
            } else {
                64
            },
            qos: if matches!(scenario, Scenario::Qos1 | Scenario::Fill | Scenario::Drain) {
                1
            } else {
                0
            },
            publishers: match scenario {
                Scenario::FanIn | Scenario::Qos1 | Scenario::Fill => 8,
                _ => 1,
            },
            subscribers: if scenario == Scenario::FanOut { 50 } else { 1 },
            pairs: 50,
            inflight: 64,
            rate: if scenario == Scenario::Latency {
                5000.0
            } else {
                0.0
            },
            count: if matches!(scenario, Scenario::Fill | Scenario::Drain) {
                1_000_000
            } else {
                15000
            },
            sources: Vec::new(),
            sources_spec: String::new(),
            hold: 10.0,
            concurrency: 256,
            batch: 65536,
            rcvlowat: 32768,
            topic_prefix: "bench".into(),
            connect_timeout: 10.0,
            connect_phase_timeout: 120.0,
            persistent_subscriber: None,
            time_limit: 120.0,
            username: None,
            password: None,
            tls_ca: None,
            tls_server_name: None,
            ws_path: None,
            sub_addrs: Vec::new(),
            pub_addrs: Vec::new(),
        }
    }
}

fn num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("--{key}: cannot parse {v:?}"))
}

/// "HOST:PORT,HOST:PORT,...".
fn addr_list(key: &str, v: &str) -> Result<Vec<String>, String> {
    let addrs: Vec<String> = v.split(',').map(|a| a.trim().to_string()).collect();
    for a in &addrs {
        let ok = a
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !ok {
            return Err(format!("--{key}: {a:?} is not HOST:PORT"));
        }
    }
    Ok(addrs)
}

fn secs(key: &str, v: &str) -> Result<f64, String> {
    let x: f64 = num(key, v)?;
    if !(0.0..=86_400.0).contains(&x) {
        return Err(format!(
            "--{key}: {v} is not a number of seconds in 0..=86400"
        ));
    }
    Ok(x)
}

pub fn parse(args: &[String]) -> Result<Opts, String> {
    let mut scenario = None;
    let mut pairs: Vec<(String, String)> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "-h" || a == "--help" {
            return Err("help".into());
        }
        if let Some(opt) = a.strip_prefix("--") {
            let (k, v) = match opt.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (
                    opt.to_string(),
                    it.next()
                        .ok_or_else(|| format!("--{opt} needs a value"))?
                        .clone(),
                ),
            };
            pairs.push((k, v));
        } else if scenario.is_none() {
            scenario = Some(Scenario::parse(a).ok_or_else(|| format!("unknown scenario {a:?}"))?);
        } else {
            return Err(format!("unexpected argument {a:?}"));
        }
    }
    let scenario = scenario.ok_or("no scenario given")?;
    let mut o = Opts::defaults(scenario);
    for (k, v) in &pairs {
        let v = v.as_str();
        match k.as_str() {
            "host" => o.host = v.to_string(),
            "port" => o.port = num(k, v)?,
            "duration" => o.duration = secs(k, v)?,
            "warmup" => o.warmup = secs(k, v)?,
            "protocol" => {
                o.protocol = match v {
                    "4" | "3.1.1" | "311" | "v311" => Protocol::V311,
                    "5" | "5.0" | "v5" => Protocol::V5,
                    _ => return Err(format!("--protocol: {v:?} (use 4 for 3.1.1 or 5)")),
                }
            }
            "payload" => o.payload = num(k, v)?,
            "qos" => o.qos = num(k, v)?,
            "publishers" => o.publishers = num(k, v)?,
            "subscribers" => o.subscribers = num(k, v)?,
            "pairs" => o.pairs = num(k, v)?,
            "inflight" => o.inflight = num(k, v)?,
            "rate" => o.rate = num(k, v)?,
            "count" => o.count = num(k, v)?,
            "sources" => {
                o.sources = net::parse_sources(v)?;
                o.sources_spec = v.to_string();
            }
            "hold" => o.hold = secs(k, v)?,
            "concurrency" => o.concurrency = num(k, v)?,
            "batch" => o.batch = num(k, v)?,
            "rcvlowat" => o.rcvlowat = num(k, v)?,
            "topic-prefix" => o.topic_prefix = v.to_string(),
            "connect-timeout" => o.connect_timeout = secs(k, v)?,
            "connect-phase-timeout" => o.connect_phase_timeout = secs(k, v)?,
            "persistent-subscriber" => o.persistent_subscriber = Some(v.to_string()),
            "time-limit" => o.time_limit = secs(k, v)?,
            "username" => o.username = Some(v.to_string()),
            "password" => o.password = Some(v.to_string()),
            "tls-ca" => o.tls_ca = Some(v.to_string()),
            "tls-server-name" => o.tls_server_name = Some(v.to_string()),
            "ws-path" => o.ws_path = Some(v.to_string()),
            "sub-addrs" => o.sub_addrs = addr_list(k, v)?,
            "pub-addrs" => o.pub_addrs = addr_list(k, v)?,
            _ => return Err(format!("unknown option --{k}")),
        }
    }
    validate(&o)?;
    Ok(o)
}

fn validate(o: &Opts) -> Result<(), String> {
    if o.duration <= 0.0 {
        return Err("--duration must be > 0".into());
    }
    if o.qos > 1 {
        return Err("--qos: only 0 and 1 are supported".into());
    }
    if matches!(
        o.scenario,
        Scenario::Qos1 | Scenario::Fill | Scenario::Drain
    ) && o.qos != 1
    {
        return Err(format!("{}: --qos must be 1", o.scenario.name()));
    }
    match &o.persistent_subscriber {
        Some(id) if id.is_empty() || id.len() > 65_535 => {
            return Err("--persistent-subscriber: a client id of 1..=65535 bytes".into());
        }
        Some(_)
            if !matches!(
                o.scenario,
                Scenario::Qos1
                    | Scenario::FanIn
                    | Scenario::Throughput
                    | Scenario::Latency
                    | Scenario::Fill
                    | Scenario::Drain
            ) =>
        {
            return Err(format!(
                "--persistent-subscriber: not for {} (only scenarios with one subscriber)",
                o.scenario.name()
            ));
        }
        None if matches!(o.scenario, Scenario::Fill | Scenario::Drain) => {
            return Err(format!(
                "{}: --persistent-subscriber ID is required",
                o.scenario.name()
            ));
        }
        _ => {}
    }
    if (o.tls_ca.is_some() || o.ws_path.is_some())
        && matches!(o.scenario, Scenario::Connections | Scenario::Loopback)
    {
        return Err(format!(
            "{}: --tls-ca and --ws-path are for the message scenarios",
            o.scenario.name()
        ));
    }
    if o.tls_server_name.is_some() && o.tls_ca.is_none() {
        return Err("--tls-server-name needs --tls-ca".into());
    }
    if o.ws_path
        .as_ref()
        .is_some_and(|p| !p.starts_with('/') || p.contains(char::is_whitespace))
    {
        return Err("--ws-path must start with / and hold no white space".into());
    }
    if o.password.is_some() && o.username.is_none() {
        return Err("--password needs --username (MQTT 3.1.1)".into());
    }
    if o.time_limit <= 0.0 {
        return Err("--time-limit must be > 0".into());
    }
    if o.scenario == Scenario::Latency {
        if o.qos != 0 {
            return Err("latency: only --qos 0".into());
        }
        if o.payload < 8 {
            return Err("latency: --payload must be >= 8 (it carries the send time)".into());
        }
        if !(o.rate > 0.0 && o.rate <= 10_000_000.0) {
            return Err("latency: --rate must be in (0, 1e7] msg/s".into());
        }
    }
    if !(o.rate >= 0.0 && o.rate.is_finite()) {
        return Err("--rate must be >= 0".into());
    }
    if o.payload > 256 * 1024 * 1024 - 1024 {
        return Err("--payload too large for one MQTT packet".into());
    }
    if o.scenario == Scenario::Loopback && o.payload == 0 {
        return Err("loopback: --payload must be > 0".into());
    }
    for (name, v, max) in [
        ("publishers", o.publishers, 10_000),
        ("subscribers", o.subscribers, 10_000),
        ("pairs", o.pairs, 5_000),
        ("concurrency", o.concurrency, 4_096),
    ] {
        if v == 0 || v > max {
            return Err(format!("--{name} must be in 1..={max}"));
        }
    }
    if o.inflight == 0 || o.inflight > 65_535 {
        return Err("--inflight must be in 1..=65535".into());
    }
    if o.count == 0 {
        return Err("--count must be > 0".into());
    }
    if o.batch == 0 || o.batch > 64 * 1024 * 1024 {
        return Err("--batch must be in 1..=67108864 bytes".into());
    }
    if o.rcvlowat > crate::run::READ_BUF {
        return Err(format!(
            "--rcvlowat must be at most {}",
            crate::run::READ_BUF
        ));
    }
    if o.connect_timeout <= 0.0 {
        return Err("--connect-timeout must be > 0".into());
    }
    if o.topic_prefix.is_empty() || o.topic_prefix.contains(['+', '#', '\0']) {
        return Err("--topic-prefix must be a non-empty topic without wildcards".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Opts, String> {
        parse(&s.split_whitespace().map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn defaults_per_scenario() {
        let o = p("fan-in --port 1884").unwrap();
        assert_eq!((o.publishers, o.payload, o.qos, o.port), (8, 64, 0, 1884));
        let o = p("qos1 --inflight=32 --protocol 5").unwrap();
        assert_eq!((o.qos, o.inflight, o.protocol), (1, 32, Protocol::V5));
        let o = p("fan-out").unwrap();
        assert_eq!(o.subscribers, 50);
        let o = p("latency --duration 0.5").unwrap();
        assert_eq!((o.rate, o.duration), (5000.0, 0.5));
        let o = p("connections --count 100 --sources 127.0.0.2-127.0.0.3 --hold 0").unwrap();
        assert_eq!((o.count, o.sources.len(), o.hold), (100, 2, 0.0));
        assert_eq!(p("loopback").unwrap().payload, 65536);
        let o = p("qos1 --persistent-subscriber bench-sub").unwrap();
        assert_eq!(o.persistent_subscriber.as_deref(), Some("bench-sub"));
        let o = p("fill --persistent-subscriber s --count 1000").unwrap();
        assert_eq!((o.count, o.qos, o.publishers, o.inflight), (1000, 1, 8, 64));
        let o = p("drain --persistent-subscriber s --time-limit 30").unwrap();
        assert_eq!((o.count, o.time_limit), (1_000_000, 30.0));
        let o = p("pairs --tls-ca ca.pem --username u --password pw --ws-path /mqtt").unwrap();
        assert_eq!(o.tls_ca.as_deref(), Some("ca.pem"));
        assert_eq!(
            (o.username.as_deref(), o.password.as_deref()),
            (Some("u"), Some("pw"))
        );
        assert_eq!(o.ws_path.as_deref(), Some("/mqtt"));
        let o = p("connections --username u --password pw").unwrap();
        assert_eq!(o.username.as_deref(), Some("u"));
    }

    #[test]
    fn errors() {
        assert!(p("").is_err());
        assert!(p("nope").is_err());
        assert!(p("fan-in --bogus 1").is_err());
        assert!(p("fan-in --port").is_err());
        assert!(p("fan-in --port x").is_err());
        assert!(p("qos1 --qos 0").is_err());
        assert!(p("latency --payload 4").is_err());
        assert!(p("fan-in --duration 0").is_err());
        assert!(p("fan-in --qos 2").is_err());
        assert!(p("fill").is_err()); // needs --persistent-subscriber
        assert!(p("drain --persistent-subscriber s --qos 0").is_err());
        assert!(p("fan-out --persistent-subscriber s").is_err());
        assert!(p("fill --persistent-subscriber s --time-limit 0").is_err());
        assert!(p("connections --tls-ca ca.pem").is_err());
        assert!(p("connections --ws-path /mqtt").is_err());
        assert!(p("pairs --ws-path mqtt").is_err());
        assert!(p("pairs --password pw").is_err());
        assert!(p("pairs --tls-server-name x").is_err());
    }
}
