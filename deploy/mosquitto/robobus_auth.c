/* robobus broker plugin (mosquitto 2.0 plugin API v5): binds client ids to users and replies to requests.
 *
 * 1. Client ids belong to users. A client of user U must connect with the client id U or U-<anything>
 *    (the kit's clients: "<user>-<what>-<random>", shared/mqtt/session.py bound_client_id). Any other id is refused
 *    at CONNECT (CONNACK 135 not authorized), so no user can take over, or kick off, another user's session,
 *    and `pattern ... {root}/_client/%c/reply` in the ACL file is a reply topic of that user only.
 *    make_secrets.py refuses user names where one is another's prefix followed by '-'.
 * 2. Replies only to requests received. A write to <...>/_client/<client id>/reply by user U is refused
 *    (PUBACK 135) unless the client id is U's own, or a request naming that Response Topic reached U's node,
 *    i.e. was published on <root>/U/<device>/cmd/<name> by someone other than U, within the last
 *    `plugin_opt_reply_ttl` seconds (default 600), by the client whose reply topic it is: a request grants
 *    only when its Response Topic is <...>/_client/<the sender's own client id>/reply, or when it came over a
 *    fleet bridge (user bridge-*: the centre checked its sender). So a node that may call another (can-bootloader
 *    leases ethercat-loop's CAN bridge) cannot have it answer onto a third client's reply topic (the operator's):
 *    the request still reaches the node, its reply there is refused. Users named bridge-* (a fleet centre's site
 *    bridges) relay the replies of their site, whose broker checked them: the ACL file limits them to the site's root.
 *    So may the users named in `plugin_opt_relay_users` (space-separated; default "fleet-gate": the centre's
 *    answer for a cut-off site, deploy/fleet_gate.py).
 *    The ACL file is still consulted for everything this plugin lets through.
 * Built into the broker image (deploy/docker/broker.Dockerfile); tests build it on the host
 * (tests/deploy/deployfiles.py). Needs Debian's mosquitto-dev and libmosquitto-dev (2.0.11): libmosquitto's
 * mosquitto_property_read_string reads the Response Topic (the broker does not export it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mosquitto.h>
#include <mosquitto_broker.h>
#include <mosquitto_plugin.h>
#include <mqtt_protocol.h>

#define MAX_GRANTS 4096

struct grant {
	char *user;   /* the node (= its broker user) the request was sent to */
	char *topic;  /* the request's Response Topic */
	time_t until;
};

static mosquitto_plugin_id_t *plugin_id;
static struct grant grants[MAX_GRANTS];
static long reply_ttl_s = 600;
static char relay_users[1024] = " fleet-gate ";  /* space-delimited on both sides */
static unsigned long refused_ids, refused_replies, refused_grants;

static int id_is_users(const char *id, const char *user)
{
	size_t n = strlen(user);
	return id && user && strncmp(id, user, n) == 0 && (id[n] == '\0' || id[n] == '-');
}

/* "<...>/_client/<id>/reply": the client id, copied into buf; NULL for any other topic. */
static const char *reply_client(const char *topic, char *buf, size_t len)
{
	size_t t = strlen(topic);
	const char *end, *start;
	if(t < 15 || strcmp(topic + t - 6, "/reply") != 0) return NULL;
	end = topic + t - 6;
	start = end;
	while(start > topic && start[-1] != '/') start--;
	if(start - topic < 9 || strncmp(start - 9, "/_client/", 9) != 0) {
		if(!(start - topic == 8 && strncmp(topic, "_client/", 8) == 0)) return NULL;
	}
	if((size_t)(end - start) >= len || end == start) return NULL;
	memcpy(buf, start, (size_t)(end - start));
	buf[end - start] = '\0';
	return buf;
}

/* "<root>/<node>/<device>/cmd/<name>" (root one level or more): the node, copied into buf; else NULL. */
static const char *command_node(const char *topic, char *buf, size_t len)
{
	const char *seg[5];
	int n = 0;
	const char *p = topic + strlen(topic);
	while(p > topic && n < 5) {  /* the starts of the last five segments, last first */
		p--;
		if(*p == '/') seg[n++] = p + 1;
	}
	if(n < 4) return NULL;  /* fewer than 5 levels */
	if(strncmp(seg[1], "cmd/", 4) != 0) return NULL;
	if(seg[2] >= seg[1] || seg[3] >= seg[2]) return NULL;
	size_t nl = (size_t)(seg[2] - seg[3] - 1);
	if(nl == 0 || nl >= len) return NULL;
	memcpy(buf, seg[3], nl);
	buf[nl] = '\0';
	return buf;
}

static void grant(const char *user, const char *topic, time_t now)
{
	int free_slot = -1, oldest = 0;
	for(int i = 0; i < MAX_GRANTS; i++) {
		if(!grants[i].user) {
			if(free_slot < 0) free_slot = i;
			continue;
		}
		if(!strcmp(grants[i].user, user) && !strcmp(grants[i].topic, topic)) {
			grants[i].until = now + reply_ttl_s;
			return;
		}
		if(grants[i].until < now && free_slot < 0) free_slot = i;
		if(grants[i].until < grants[oldest].until) oldest = i;
	}
	int i = free_slot >= 0 ? free_slot : oldest;  /* full: the oldest grant goes */
	free(grants[i].user);
	free(grants[i].topic);
	grants[i].user = strdup(user);
	grants[i].topic = strdup(topic);
	grants[i].until = now + reply_ttl_s;
	if(!grants[i].user || !grants[i].topic) {
		free(grants[i].user);
		free(grants[i].topic);
		grants[i].user = grants[i].topic = NULL;
	}
}

static int granted(const char *user, const char *topic, time_t now)
{
	for(int i = 0; i < MAX_GRANTS; i++) {
		if(grants[i].user && grants[i].until >= now && !strcmp(grants[i].user, user)
				&& !strcmp(grants[i].topic, topic)) {
			return 1;
		}
	}
	return 0;
}

static int is_relay(const char *user)
{
	char key[300];
	if(strlen(user) > 256) return 0;
	snprintf(key, sizeof(key), " %s ", user);
	return strstr(relay_users, key) != NULL;
}

/* A request's Response Topic that its sender may name: its own reply topic, <...>/_client/<its client id>/reply, or
 * anything relayed by a fleet bridge (the centre's broker bound the requester's reply topic to the requester). For
 * a bridge's publishes mosquitto_client_username() is the bridge's local_username, unset in the generated
 * bridge.conf: no username. Every shipped broker refuses anonymous clients, so only a bridge has none. */
static int names_own_reply_topic(const struct mosquitto *client, const char *sender, const char *response)
{
	char id[256];
	const char *own = mosquitto_client_id(client);
	if(!sender || !strncmp(sender, "bridge-", 7)) return 1;
	if(!own || !reply_client(response, id, sizeof(id))) return 0;
	return !strcmp(id, own);
}

static int on_basic_auth(int event, void *event_data, void *userdata)
{
	struct mosquitto_evt_basic_auth *ed = event_data;
	const char *id = mosquitto_client_id(ed->client);
	(void)event;
	(void)userdata;
	if(!ed->username) return MOSQ_ERR_PLUGIN_DEFER;  /* anonymous: the broker's allow_anonymous decides */
	if(id_is_users(id, ed->username)) return MOSQ_ERR_PLUGIN_DEFER;  /* the password file decides */
	refused_ids++;
	mosquitto_log_printf(MOSQ_LOG_NOTICE, "robobus_auth: refused client id '%s' for user '%s': a client of "
			"user U connects as U or U-<anything> (refused ids so far: %lu)", id ? id : "", ed->username,
			refused_ids);
	return MOSQ_ERR_AUTH;
}

static int on_message(int event, void *event_data, void *userdata)
{
	struct mosquitto_evt_message *ed = event_data;
	char node[256];
	char *response = NULL;
	const char *sender;
	(void)event;
	(void)userdata;
	if(!ed->topic || !strstr(ed->topic, "/cmd/")) return MOSQ_ERR_SUCCESS;
	if(!command_node(ed->topic, node, sizeof(node))) return MOSQ_ERR_SUCCESS;
	sender = mosquitto_client_username(ed->client);
	if(sender && !strcmp(sender, node)) return MOSQ_ERR_SUCCESS;  /* a node's request to itself grants nothing */
	if(!mosquitto_property_read_string(ed->properties, MQTT_PROP_RESPONSE_TOPIC, &response, false)) {
		return MOSQ_ERR_SUCCESS;
	}
	if(names_own_reply_topic(ed->client, sender, response)) {
		grant(node, response, time(NULL));
	}else{
		refused_grants++;
		if(refused_grants <= 10 || refused_grants % 1000 == 0) {
			mosquitto_log_printf(MOSQ_LOG_NOTICE, "robobus_auth: a request from client '%s' (user '%s') on %s "
					"names the response topic %s, not its own: %s may not answer there (refused so far: %lu)",
					mosquitto_client_id(ed->client) ? mosquitto_client_id(ed->client) : "", sender ? sender : "",
					ed->topic, response, node, refused_grants);
		}
	}
	free(response);
	return MOSQ_ERR_SUCCESS;
}

static int on_acl_check(int event, void *event_data, void *userdata)
{
	struct mosquitto_evt_acl_check *ed = event_data;
	char id[256];
	const char *user, *owner;
	(void)event;
	(void)userdata;
	if(ed->access != MOSQ_ACL_WRITE || !ed->topic) return MOSQ_ERR_PLUGIN_DEFER;
	owner = reply_client(ed->topic, id, sizeof(id));
	if(!owner) return MOSQ_ERR_PLUGIN_DEFER;
	user = mosquitto_client_username(ed->client);
	if(!user) return MOSQ_ERR_PLUGIN_DEFER;
	if(id_is_users(owner, user)) return MOSQ_ERR_PLUGIN_DEFER;  /* its own reply topic */
	if(!strncmp(user, "bridge-", 7)) return MOSQ_ERR_PLUGIN_DEFER;  /* a site's bridge relays its replies */
	if(is_relay(user)) return MOSQ_ERR_PLUGIN_DEFER;
	if(granted(user, ed->topic, time(NULL))) return MOSQ_ERR_PLUGIN_DEFER;
	refused_replies++;
	if(refused_replies <= 10 || refused_replies % 1000 == 0) {
		mosquitto_log_printf(MOSQ_LOG_NOTICE, "robobus_auth: refused a reply from user '%s' on %s: no request "
				"with that response topic reached it (refused replies so far: %lu)", user, ed->topic,
				refused_replies);
	}
	return MOSQ_ERR_ACL_DENIED;
}

int mosquitto_plugin_version(int supported_version_count, const int *supported_versions)
{
	for(int i = 0; i < supported_version_count; i++) {
		if(supported_versions[i] == 5) return 5;
	}
	return -1;
}

int mosquitto_plugin_init(mosquitto_plugin_id_t *identifier, void **user_data, struct mosquitto_opt *opts,
		int opt_count)
{
	(void)user_data;
	plugin_id = identifier;
	for(int i = 0; i < opt_count; i++) {
		if(!strcmp(opts[i].key, "reply_ttl")) {
			char *end;
			long v = strtol(opts[i].value, &end, 10);
			if(*end || v <= 0) {
				mosquitto_log_printf(MOSQ_LOG_ERR, "robobus_auth: reply_ttl must be seconds > 0, not '%s'",
						opts[i].value);
				return MOSQ_ERR_INVAL;
			}
			reply_ttl_s = v;
		}else if(!strcmp(opts[i].key, "relay_users")) {
			if(strlen(opts[i].value) + 3 > sizeof(relay_users)) return MOSQ_ERR_INVAL;
			snprintf(relay_users, sizeof(relay_users), " %s ", opts[i].value);
		}
	}
	if(mosquitto_callback_register(plugin_id, MOSQ_EVT_BASIC_AUTH, on_basic_auth, NULL, NULL)
			|| mosquitto_callback_register(plugin_id, MOSQ_EVT_ACL_CHECK, on_acl_check, NULL, NULL)
			|| mosquitto_callback_register(plugin_id, MOSQ_EVT_MESSAGE, on_message, NULL, NULL)) {
		return MOSQ_ERR_UNKNOWN;
	}
	mosquitto_log_printf(MOSQ_LOG_NOTICE, "robobus_auth: client ids bound to users, replies to requests "
			"received (reply_ttl %ld s, relays bridge-* and%s)", reply_ttl_s, relay_users);
	return MOSQ_ERR_SUCCESS;
}

int mosquitto_plugin_cleanup(void *user_data, struct mosquitto_opt *opts, int opt_count)
{
	(void)user_data;
	(void)opts;
	(void)opt_count;
	mosquitto_callback_unregister(plugin_id, MOSQ_EVT_BASIC_AUTH, on_basic_auth, NULL);
	mosquitto_callback_unregister(plugin_id, MOSQ_EVT_ACL_CHECK, on_acl_check, NULL);
	mosquitto_callback_unregister(plugin_id, MOSQ_EVT_MESSAGE, on_message, NULL);
	for(int i = 0; i < MAX_GRANTS; i++) {
		free(grants[i].user);
		free(grants[i].topic);
		grants[i].user = grants[i].topic = NULL;
	}
	return MOSQ_ERR_SUCCESS;
}
