//! Authorization: what one connection may publish, subscribe to and receive. Allow-only
//! rules of rights over topic filters, given by the caller (after `%c` / `%u` substitution)
//! and compiled once; many connections share one `Permissions` through an `Arc`.

use crate::topics;

/// Right to PUBLISH to topics the rule's filter matches.
pub const PUBLISH: u8 = 1;
/// Right to SUBSCRIBE to filters inside the rule's filter.
pub const SUBSCRIBE: u8 = 2;
/// Right to receive messages on topics the rule's filter matches.
pub const READ: u8 = 4;

/// The filters that grant one right.
#[derive(Debug, Default)]
struct Grant {
    /// A `#` rule: every topic not starting with `$`, without looking at the others.
    all: bool,
    filters: Vec<Box<str>>,
}

impl Grant {
    fn allows(&self, topic: &[u8]) -> bool {
        (self.all && topic.first() != Some(&b'$'))
            || self.filters.iter().any(|f| topics::matches(f, topic))
    }

    fn covers(&self, filter: &str) -> bool {
        self.filters.iter().any(|rule| filter_covers(rule, filter))
    }
}

/// Compiled permissions of a connection.
#[derive(Debug, Default)]
pub struct Permissions {
    rules: Vec<(u8, String)>,
    publish: Grant,
    subscribe: Grant,
    read: Grant,
}

impl Permissions {
    /// Compiles `(rights mask, filter)` rules; the error names the first bad rule.
    pub fn new(rules: Vec<(u8, String)>) -> Result<Permissions, String> {
        let mut p = Permissions::default();
        for (rights, filter) in &rules {
            if *rights > PUBLISH | SUBSCRIBE | READ {
                return Err(format!(
                    "rights {rights} of rule {filter:?} is not a mask of 1, 2 and 4"
                ));
            }
            if !topics::valid_filter(filter) {
                return Err(format!("{filter:?} is not a valid topic filter"));
            }
            if topics::split_shared(filter).is_some() {
                // Shared subscriptions are checked by their filter part, so a rule is plain.
                return Err(format!(
                    "{filter:?}: a rule is a plain filter, not a $share/ one"
                ));
            }
            for (bit, grant) in [
                (PUBLISH, &mut p.publish),
                (SUBSCRIBE, &mut p.subscribe),
                (READ, &mut p.read),
            ] {
                if rights & bit != 0 {
                    grant.all |= filter == "#";
                    grant.filters.push(filter.as_str().into());
                }
            }
        }
        p.rules = rules;
        Ok(p)
    }

    pub fn rules(&self) -> &[(u8, String)] {
        &self.rules
    }

    fn grant(&self, right: u8) -> Option<&Grant> {
        match right {
            PUBLISH => Some(&self.publish),
            SUBSCRIBE => Some(&self.subscribe),
            READ => Some(&self.read),
            _ => None,
        }
    }

    /// Whether `right` (one of PUBLISH, SUBSCRIBE, READ) is granted on topic name `topic`.
    pub fn allows(&self, right: u8, topic: &[u8]) -> bool {
        self.grant(right).is_some_and(|g| g.allows(topic))
    }

    /// Whether every topic `filter` can match is granted `right`: the filter lies inside one
    /// rule's filter. A shared subscription is judged by its filter part.
    pub fn covers(&self, right: u8, filter: &str) -> bool {
        let inner = topics::split_shared(filter).map_or(filter, |(_, f)| f);
        self.grant(right).is_some_and(|g| g.covers(inner))
    }
}

/// Whether every topic matched by `filter` is also matched by `rule` (both valid, plain):
/// `a/#` covers `a/b/+` and `a`; `a/+` does not cover `a/#`; `#` does not cover `$SYS/x`
/// (a filter starting with a wildcard matches no `$` topic, MQTT-4.7.2-1).
pub fn filter_covers(rule: &str, filter: &str) -> bool {
    if matches!(rule.as_bytes().first(), Some(b'+' | b'#'))
        && filter.as_bytes().first() == Some(&b'$')
    {
        return false;
    }
    let mut rule_levels = rule.split('/');
    let mut filter_levels = filter.split('/');
    loop {
        match (rule_levels.next(), filter_levels.next()) {
            // `#` matches the parent level too, so it covers a filter that ends here.
            (Some("#"), _) => return true,
            (Some(_), Some("#")) => return false,
            (Some("+"), Some(_)) => {}
            (Some(r), Some(f)) if r == f => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn perms(rules: &[(u8, &str)]) -> Permissions {
        Permissions::new(rules.iter().map(|(r, f)| (*r, f.to_string())).collect()).unwrap()
    }

    #[test]
    fn covers_by_level() {
        let yes = [
            ("#", "#"),
            ("#", "a/b"),
            ("#", "+/x"),
            ("a/#", "a"),
            ("a/#", "a/#"),
            ("a/#", "a/b/+"),
            ("a/+", "a/b"),
            ("a/+", "a/+"),
            ("a/+/c", "a/x/c"),
            ("+/+", "x/+"),
            ("$SYS/#", "$SYS/broker/+"),
            ("$SYS/+", "$SYS/x"),
            ("a//b", "a//b"),
            ("+/#", "a"),
        ];
        for (rule, filter) in yes {
            assert!(filter_covers(rule, filter), "{rule} should cover {filter}");
        }
        let no = [
            ("a/+", "a/#"),
            ("a/+", "a"),
            ("a/+", "a/b/c"),
            ("a/b", "a/+"),
            ("a/b", "a/b/c"),
            ("a", "a/#"),
            ("a/+/#", "a/#"),
            ("a/+/#", "a"),
            ("#", "$SYS/x"),
            ("#", "$SYS/#"),
            ("+/x", "$a/x"),
            ("b/#", "a/#"),
            ("a/b/c", "a/b"),
            ("+", "#"),
        ];
        for (rule, filter) in no {
            assert!(
                !filter_covers(rule, filter),
                "{rule} should not cover {filter}"
            );
        }
    }

    #[test]
    fn allows_per_right_and_dollar_topics() {
        let p = perms(&[
            (PUBLISH, "sensors/%u-free/#"),
            (SUBSCRIBE | READ, "cmd/+"),
            (READ, "#"),
        ]);
        assert!(p.allows(PUBLISH, b"sensors/%u-free/t"));
        assert!(!p.allows(PUBLISH, b"sensors/other/t"));
        assert!(!p.allows(PUBLISH, b"cmd/x"));
        assert!(p.allows(READ, b"anything/at/all"));
        assert!(!p.allows(READ, b"$SYS/broker/uptime"));
        assert!(p.covers(SUBSCRIBE, "cmd/x"));
        assert!(p.covers(SUBSCRIBE, "$share/g/cmd/+"));
        assert!(!p.covers(SUBSCRIBE, "cmd/#"));
        assert!(!p.covers(SUBSCRIBE, "$share/g/cmd/#"));
        assert!(p.covers(READ, "x/#"));
        assert!(!p.covers(READ, "$SYS/#"));
        assert!(!p.allows(8, b"cmd/x"));
        let none = perms(&[]);
        assert!(!none.allows(PUBLISH, b"a") && !none.covers(SUBSCRIBE, "a"));
    }

    #[test]
    fn bad_rules_are_named() {
        let err = Permissions::new(vec![(1, "a/#".into()), (2, "a/#/b".into())]).unwrap_err();
        assert!(err.contains("a/#/b"), "{err}");
        let err = Permissions::new(vec![(8, "a".into())]).unwrap_err();
        assert!(err.contains("rights 8"), "{err}");
        let err = Permissions::new(vec![(2, "$share/g/a".into())]).unwrap_err();
        assert!(err.contains("$share/g/a"), "{err}");
        assert!(Permissions::new(vec![(1, "".into())]).is_err());
    }

    fn level() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["a", "b", "$x", "", "+", "#"])
    }

    fn filter() -> impl Strategy<Value = String> {
        prop::collection::vec(level(), 1..5)
            .prop_map(|l| l.join("/"))
            .prop_filter("valid", |f| topics::valid_filter(f))
    }

    fn topic() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(vec!["a", "b", "$x", "", "c"]), 1..6)
            .prop_map(|l| l.join("/"))
    }

    proptest! {
        /// Coverage agrees with matching: if `rule` covers `filter`, every topic the filter
        /// matches, the rule matches.
        #[test]
        fn covered_filters_match_only_inside_the_rule(
            rule in filter(),
            f in filter(),
            topics_ in prop::collection::vec(topic(), 1..40),
        ) {
            if filter_covers(&rule, &f) {
                for t in &topics_ {
                    if topics::matches(&f, t.as_bytes()) {
                        prop_assert!(topics::matches(&rule, t.as_bytes()),
                            "{rule} covers {f} but not topic {t}");
                    }
                }
            }
        }
    }
}
