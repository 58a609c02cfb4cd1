// An unmodified client-go leader-elected controller, as nearly every Kubernetes operator is: it
// elects its leader on a coordination.k8s.io/v1 Lease with client-go's leaderelection package and,
// while it leads, writes a ConfigMap and the status of a custom resource. It knows nothing of
// kube-fence: fencing comes only from the labels on the objects it writes (README, "Fencing an
// existing controller").
//
// Each write merge-patches {writer: <identity>, seq: <n>} with no resourceVersion, so without
// fencing a leader that was paused past its lease and resumed would overwrite its successor's
// work. Every write's outcome is printed as one JSON line on stdout, for the tests.
//
// When it stops leading, RunOrDie returns; most controllers then exit and their Pod restarts
// them. This one campaigns again in the same process, under a fresh identity (<pod>_<new uuid>,
// as a restarted process would have), until SIGTERM: under restartPolicy Always a process that
// exits after every lost election meets the kubelet's restart back-off (10 s, doubling up to
// 5 min), which a test of a hundred hand-overs cannot wait out. Each campaign is still one
// ordinary leaderelection.RunOrDie. Before campaigning again it waits until the writes of the
// lost term have stopped, as a process's exit would stop them: a pending write of the old term
// sent after this Pod led again would be admitted (the guard knows Pods, not processes).
//
// Like most controllers it also writes objects nobody labelled, when asked to: with
// CREATE_OBJECTS=1 each write also creates a new ConfigMap (generateName <CONFIGMAP>-made-, label
// leader-go/made: "true", data writer/seq), and with PATCH_NAMESPACE=1 it also merge-patches the
// annotations leader-go/writer and leader-go/seq of its Namespace, a cluster-scoped object. Those
// are fenced only when its ServiceAccount is opted in on its Lease (kubefence.io/writers).
//
// Environment: KUBECONFIG (outside a Pod), POD_NAME (outside a Pod: the name its identity
// starts with), NAMESPACE, LEASE (the Lease's name), CONFIGMAP, RESOURCE (name of the custom
// resource), RESOURCE_GROUP/RESOURCE_VERSION/RESOURCE_PLURAL (its API), WRITE_INTERVAL (Go
// duration, default 200ms), LEASE_DURATION (default 4s; renew deadline 3/4 of it, retry 1/4),
// CREATE_OBJECTS and PATCH_NAMESPACE (1 to write those too).
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func duration(name, fallback string) time.Duration {
	d, err := time.ParseDuration(env(name, fallback))
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(2)
	}
	return d
}

// report prints one event as a JSON line.
func report(fields map[string]any) {
	fields["time"] = time.Now().UTC().Format(time.RFC3339Nano)
	line, _ := json.Marshal(fields)
	fmt.Println(string(line))
}

func main() {
	// In a Pod: its ServiceAccount token. Outside one (tests): KUBECONFIG, the way every
	// client-go program takes it.
	var config *rest.Config
	var err error
	if path := os.Getenv("KUBECONFIG"); path != "" {
		config, err = clientcmd.BuildConfigFromFlags("", path)
	} else {
		config, err = rest.InClusterConfig()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "client config: %v\n", err)
		os.Exit(1)
	}
	// A Pod's hostname is its name; POD_NAME (the downward API) says so outside one.
	hostname := os.Getenv("POD_NAME")
	if hostname == "" {
		if hostname, err = os.Hostname(); err != nil {
			fmt.Fprintf(os.Stderr, "hostname: %v\n", err)
			os.Exit(1)
		}
	}
	namespace := env("NAMESPACE", "default")
	core := kubernetes.NewForConfigOrDie(config)
	dyn := dynamic.NewForConfigOrDie(config)
	resource := schema.GroupVersionResource{
		Group:    env("RESOURCE_GROUP", "example.kubefence.io"),
		Version:  env("RESOURCE_VERSION", "v1"),
		Resource: env("RESOURCE_PLURAL", "widgets"),
	}
	leaseDuration := duration("LEASE_DURATION", "4s")
	interval := duration("WRITE_INTERVAL", "200ms")

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	for ctx.Err() == nil {
		// controller-runtime's identity: the Pod's hostname (its name), "_", a fresh UUID.
		identity := hostname + "_" + string(uuid.NewUUID())
		campaign(ctx, core, dyn, resource, namespace, identity, leaseDuration, interval)
	}
}

// campaign runs one leader election under identity until it stops leading (or ctx ends), and
// returns once the writes of its term, if it led, have stopped.
func campaign(ctx context.Context, core kubernetes.Interface, dyn dynamic.Interface, resource schema.GroupVersionResource, namespace, identity string, leaseDuration, interval time.Duration) {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: env("LEASE", "leader-go"), Namespace: namespace},
		Client:     core.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: identity},
	}
	// RunOrDie starts OnStartedLeading in a goroutine of its own and returns without waiting
	// for it; written to when that goroutine's writes have stopped.
	term := make(chan struct{}, 1)
	report(map[string]any{"event": "started", "identity": identity})
	leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   leaseDuration,
		RenewDeadline:   leaseDuration * 3 / 4,
		RetryPeriod:     leaseDuration / 4,
		ReleaseOnCancel: true,
		Name:            "leader-go",
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				report(map[string]any{"event": "leading", "identity": identity})
				lead(ctx, core, dyn, resource, namespace, identity, interval)
				term <- struct{}{}
			},
			OnStoppedLeading: func() {
				report(map[string]any{"event": "stopped-leading", "identity": identity})
			},
			OnNewLeader: func(leader string) {
				report(map[string]any{"event": "new-leader", "identity": identity, "leader": leader})
			},
		},
	})
	// RunOrDie returns before ctx ends only after it led (it campaigns until it acquires).
	if ctx.Err() == nil {
		<-term
	}
}

// lead writes the ConfigMap and the custom resource's status every interval while ctx lasts.
func lead(ctx context.Context, core kubernetes.Interface, dyn dynamic.Interface, resource schema.GroupVersionResource, namespace, identity string, interval time.Duration) {
	configMap := env("CONFIGMAP", "leader-go")
	custom := env("RESOURCE", "leader-go")
	// Like a reconcile loop, a write once due is sent: leadership is looked at between writes,
	// not inside one. A leader paused mid-loop sends its pending write when it resumes.
	for seq := 1; ctx.Err() == nil; seq++ {
		time.Sleep(interval)
		data, _ := json.Marshal(map[string]any{"data": map[string]string{"writer": identity, "seq": strconv.Itoa(seq)}})
		_, err := core.CoreV1().ConfigMaps(namespace).Patch(context.Background(), configMap, types.MergePatchType, data, metav1.PatchOptions{})
		outcome("configmap/"+configMap, identity, seq, err)
		status, _ := json.Marshal(map[string]any{"status": map[string]string{"writer": identity, "seq": strconv.Itoa(seq)}})
		_, err = dyn.Resource(resource).Namespace(namespace).Patch(context.Background(), custom, types.MergePatchType, status, metav1.PatchOptions{}, "status")
		outcome(resource.Resource+"/"+custom+"/status", identity, seq, err)
		if os.Getenv("CREATE_OBJECTS") == "1" {
			made := &corev1.ConfigMap{
				ObjectMeta: metav1.ObjectMeta{GenerateName: configMap + "-made-", Labels: map[string]string{"leader-go/made": "true"}},
				Data:       map[string]string{"writer": identity, "seq": strconv.Itoa(seq)},
			}
			_, err = core.CoreV1().ConfigMaps(namespace).Create(context.Background(), made, metav1.CreateOptions{})
			outcome("configmaps/made", identity, seq, err)
		}
		if os.Getenv("PATCH_NAMESPACE") == "1" {
			ns, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{"leader-go/writer": identity, "leader-go/seq": strconv.Itoa(seq)}}})
			_, err = core.CoreV1().Namespaces().Patch(context.Background(), namespace, types.MergePatchType, ns, metav1.PatchOptions{})
			outcome("namespace/"+namespace, identity, seq, err)
		}
	}
}

func outcome(object, identity string, seq int, err error) {
	fields := map[string]any{"event": "write", "object": object, "identity": identity, "seq": seq, "accepted": err == nil}
	if err != nil {
		fields["code"] = 0
		if status, ok := err.(apierrors.APIStatus); ok {
			fields["code"] = status.Status().Code
			fields["reason"] = string(status.Status().Reason)
		}
		fields["error"] = err.Error()
	}
	report(fields)
}
