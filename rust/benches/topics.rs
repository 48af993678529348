//! Subscription index micro-benchmarks: topic lookups against 100,000 subscriptions, and
//! insert/remove churn on that populated index.
//!
//! The subscriptions (keys are distinct `u32`s, like the engine's session ids):
//! - 90,000 exact: `site/SSS/device/DDDD/temp`, 900 sites x 100 devices;
//! - 9,000 with `+`: 2,700 `site/SSS/device/+/{humidity,pressure,status}` (every site),
//!   3,000 `site/SSS/+/DDDD/temp` (sites 0..30), 3,000 `+/SSS/device/DDDD/temp` (sites
//!   30..60; a root `+`, so every lookup also walks that branch), and 300 keys on
//!   `fleet/+/cmd`;
//! - 1,000 with `#`: 900 `site/SSS/#` (one per site) and 100 keys on `fleet/#`.
//!
//! The looked-up topics rotate through 1,024 generated ones: mostly `site/...` telemetry
//! (matching 0-3 subscriptions: sites 900..999 have none), some one level deeper (matching
//! the site's `#`), and 1% `fleet/N/cmd` matching 400.
//!
//! Run: `cargo bench --no-default-features --bench topics`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fastbroker_core::codec::QoS;
use fastbroker_core::topics::{SharedMatch, SubOpts, SubscriptionIndex};

const OPTS: SubOpts = SubOpts {
    qos: QoS::AtMostOnce,
    no_local: false,
    retain_as_published: false,
    retain_handling: 0,
    identifier: 0,
};

const METRICS: [&str; 3] = ["humidity", "pressure", "status"];

/// Deterministic xorshift, so every run looks up the same topics.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn filters() -> Vec<String> {
    let mut f = Vec::with_capacity(100_000);
    for s in 0..900 {
        for d in 0..100 {
            f.push(format!("site/{s:03}/device/{d:04}/temp"));
        }
    }
    for s in 0..900 {
        for m in METRICS {
            f.push(format!("site/{s:03}/device/+/{m}"));
        }
    }
    for s in 0..30 {
        for d in 0..100 {
            f.push(format!("site/{s:03}/+/{d:04}/temp"));
        }
    }
    for s in 30..60 {
        for d in 0..100 {
            f.push(format!("+/{s:03}/device/{d:04}/temp"));
        }
    }
    f.extend(std::iter::repeat_n("fleet/+/cmd".to_string(), 300));
    for s in 0..900 {
        f.push(format!("site/{s:03}/#"));
    }
    f.extend(std::iter::repeat_n("fleet/#".to_string(), 100));
    assert_eq!(f.len(), 100_000);
    f
}

fn index() -> SubscriptionIndex<u32> {
    let mut ix = SubscriptionIndex::new();
    for (key, filter) in filters().iter().enumerate() {
        assert!(ix.insert(filter, key as u32, OPTS));
    }
    assert_eq!(ix.len(), 100_000);
    ix
}

/// Realistic topics: (topic, how many subscriptions it should match).
fn topics(count: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    (0..count)
        .map(|_| {
            let s = rng.below(1000);
            let d = rng.below(100);
            let t = match rng.below(100) {
                0 => format!("fleet/{}/cmd", rng.below(50)),
                1..=9 => format!("site/{s:03}/device/{d:04}/temp/raw"),
                10..=39 => {
                    let m = METRICS[rng.below(3) as usize];
                    format!("site/{s:03}/device/{d:04}/{m}")
                }
                _ => format!("site/{s:03}/device/{d:04}/temp"),
            };
            t.into_bytes()
        })
        .collect()
}

fn lookup_all(
    ix: &SubscriptionIndex<u32>,
    topics: &[Vec<u8>],
    plain: &mut Vec<(u32, SubOpts)>,
) -> usize {
    let mut matched = 0;
    let mut shared: Vec<SharedMatch<'_, u32>> = Vec::new();
    for t in topics {
        plain.clear();
        shared.clear();
        ix.lookup(black_box(t), plain, &mut shared);
        matched += plain.len();
    }
    matched
}

fn lookup(c: &mut Criterion) {
    let ix = index();
    let mixed = topics(1024);
    let typical: Vec<Vec<u8>> = mixed
        .iter()
        .filter(|t| !t.starts_with(b"fleet/"))
        .cloned()
        .collect();
    let fleet = vec![b"fleet/7/cmd".to_vec()];
    let mut plain = Vec::new();

    // Sanity checks on the match counts the header promises.
    let count = |t: &[u8], plain: &mut Vec<(u32, SubOpts)>| lookup_all(&ix, &[t.to_vec()], plain);
    assert_eq!(count(b"site/042/device/0007/temp", &mut plain), 3);
    assert_eq!(count(b"site/100/device/0007/temp", &mut plain), 2);
    assert_eq!(count(b"site/100/device/0007/humidity", &mut plain), 2);
    assert_eq!(count(b"site/950/device/0007/temp", &mut plain), 0);
    assert_eq!(count(b"fleet/7/cmd", &mut plain), 400);
    let total = lookup_all(&ix, &mixed, &mut plain);
    eprintln!(
        "topics: 100,000 subscriptions; {} rotating topics, {:.2} matches per lookup on average",
        mixed.len(),
        total as f64 / mixed.len() as f64
    );

    let mut g = c.benchmark_group("topics/lookup");
    for (name, set) in [
        ("mixed", &mixed),
        ("typical_0_to_3", &typical),
        ("fleet_400", &fleet),
    ] {
        g.throughput(Throughput::Elements(set.len() as u64));
        g.bench_function(name, |b| b.iter(|| lookup_all(&ix, set, &mut plain)));
    }
    g.finish();
}

fn churn(c: &mut Criterion) {
    let mut ix = index();
    let mut g = c.benchmark_group("topics/churn");
    // One insert and one remove per element.
    const N: u32 = 1000;
    g.throughput(Throughput::Elements(2 * u64::from(N)));

    // A new subscriber on filters that already exist (the common case: many clients, few
    // distinct filters): no trie nodes made or pruned.
    let existing: Vec<String> = (0..N)
        .map(|i| format!("site/{:03}/device/{:04}/temp", i % 900, i % 100))
        .collect();
    g.bench_function("existing_filter", |b| {
        b.iter(|| {
            for (i, f) in existing.iter().enumerate() {
                ix.insert(f, 1_000_000 + i as u32, OPTS);
            }
            for (i, f) in existing.iter().enumerate() {
                ix.remove(f, 1_000_000 + i as u32);
            }
        })
    });

    // Filters nobody has: the last levels' nodes are made on insert and pruned on remove.
    let fresh: Vec<String> = (0..N)
        .map(|i| format!("site/{:03}/device/{:04}/voltage/{i}", i % 900, i % 100))
        .collect();
    g.bench_function("new_filter", |b| {
        b.iter(|| {
            for (i, f) in fresh.iter().enumerate() {
                ix.insert(f, 1_000_000 + i as u32, OPTS);
            }
            for (i, f) in fresh.iter().enumerate() {
                ix.remove(f, 1_000_000 + i as u32);
            }
        })
    });
    g.finish();
    assert_eq!(ix.len(), 100_000);
}

criterion_group!(benches, lookup, churn);
criterion_main!(benches);
